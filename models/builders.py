"""Model builders by name: ``create_model("videovit-tiny", ...)``, ``create_model("r2plus1d_18", ...)``.

Every model takes uint8 clips ``[B, T, H, W, 3]`` straight from the clip store
(normalisation is its first layer, on the device) and is a flat sequence of
layers, so it can also be built stage by stage for a pipeline. Each builder
states the input it accepts; a clip store that cannot provide it is refused
before training starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from clipforge.base.errors import UserError
from clipforge.rundir import RunDir, RunRecord

from . import videovit

# Kinetics statistics, as torchvision's video models were trained with.
KINETICS_MEAN = (0.43216, 0.394666, 0.37645)
KINETICS_STD = (0.22803, 0.22145, 0.216989)


class ModelError(UserError):
    """A model name, size or input that cannot work; the message says what to choose instead."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """The clips a model accepts."""

    frames: int | None = None
    """Exactly this many frames, or any when None."""
    size: int | None = None
    """Exactly this height and width, or any when None."""
    frames_multiple: int = 1
    size_multiple: int = 1
    min_size: int = 16

    def problem(self, frames: int, height: int, width: int) -> str | None:
        if self.frames is not None and frames != self.frames:
            return f"needs {self.frames} frames per clip, the clips have {frames}"
        if self.size is not None and (height, width) != (self.size, self.size):
            return f"needs {self.size}x{self.size} frames, the clips are {height}x{width}"
        if frames % self.frames_multiple:
            return f"needs a multiple of {self.frames_multiple} frames, the clips have {frames}"
        if height % self.size_multiple or width % self.size_multiple or min(height, width) < self.min_size:
            return (
                f"needs frames at least {self.min_size} px and a multiple of {self.size_multiple}, "
                f"the clips are {height}x{width}"
            )
        return None


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a builder produces for given classes and input: its layers, in order, and its cost."""

    name: str
    layers: list[tuple[Callable[..., nn.Module], tuple]]
    """(layer constructor, arguments): a pipeline stage builds only its own."""
    input: InputSpec
    splittable: bool
    """Whether the layers may be cut into pipeline stages (False: one opaque layer)."""
    flops: Callable[[], int] | None = None
    """Analytic forward FLOPs per clip, where known."""

    def build(self, seed: int | None = None) -> nn.Sequential:
        """The whole model; with ``seed``, layer i is initialised from seed + i, as a pipeline stage would."""
        layers = []
        for i, (make, args) in enumerate(self.layers):
            if seed is not None:
                torch.manual_seed(seed + i)
            layers.append(make(*args))
        return nn.Sequential(*layers)


class Normalize(nn.Module):
    """uint8 ``[B, T, H, W, 3]`` to normalised float ``[B, 3, T, H, W]`` (torchvision's video layout)."""

    def __init__(self, mean: tuple[float, ...] = KINETICS_MEAN, std: tuple[float, ...] = KINETICS_STD) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1, 1) * 255, persistent=False)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        dtype = self.mean.dtype if not torch.is_floating_point(clips) else clips.dtype
        x = clips.permute(0, 4, 1, 2, 3).to(dtype)
        return ((x - self.mean) / self.std).contiguous()


class MeanOver(nn.Module):
    """Mean over the given dimensions (S3D's head ends with one)."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=self.dims)


def _torchvision_part(name: str, num_classes: int, part: str) -> nn.Module:
    """One top-level part of a torchvision video model (each stage builds the whole model once, keeps one part)."""
    import torchvision.models.video as tvv

    model = getattr(tvv, name)(weights=None, num_classes=num_classes)
    return model if part == "" else getattr(model, part)


def _torchvision(
    name: str, num_classes: int, parts: list[str], spec: InputSpec, tail: list[tuple[Callable, tuple]] = ()
) -> Architecture:
    layers: list[tuple[Callable[..., nn.Module], tuple]] = [(Normalize, ())]
    for part in parts:
        layers.append((_torchvision_part, (name, num_classes, part)))
        if part == "avgpool" and name.startswith(("r3d", "mc3", "r2plus1d")):
            layers.append((nn.Flatten, (1,)))
    layers += list(tail)
    return Architecture(name, layers, spec, splittable=parts != [""])


_RESNET_PARTS = ["stem", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]
TORCHVISION: dict[str, Callable[[int], Architecture]] = {
    "r3d_18": lambda k: _torchvision("r3d_18", k, _RESNET_PARTS, InputSpec(min_size=32)),
    "mc3_18": lambda k: _torchvision("mc3_18", k, _RESNET_PARTS, InputSpec(min_size=32)),
    "r2plus1d_18": lambda k: _torchvision("r2plus1d_18", k, _RESNET_PARTS, InputSpec(min_size=32)),
    "s3d": lambda k: _torchvision(
        "s3d",
        k,
        ["features", "avgpool", "classifier"],
        InputSpec(frames_multiple=8, min_size=224),
        [(MeanOver, ((2, 3, 4),))],
    ),
    # MViT reshapes tokens to a fixed grid: 112 px fails inside with a reshape error, so refuse it up front.
    "mvit_v1_b": lambda k: _torchvision("mvit_v1_b", k, [""], InputSpec(frames=16, size=224)),
    "mvit_v2_s": lambda k: _torchvision("mvit_v2_s", k, [""], InputSpec(frames=16, size=224)),
    "swin3d_t": lambda k: _torchvision(
        "swin3d_t", k, [""], InputSpec(frames_multiple=2, size_multiple=32, min_size=64)
    ),
    "swin3d_s": lambda k: _torchvision(
        "swin3d_s", k, [""], InputSpec(frames_multiple=2, size_multiple=32, min_size=64)
    ),
    "swin3d_b": lambda k: _torchvision(
        "swin3d_b", k, [""], InputSpec(frames_multiple=2, size_multiple=32, min_size=64)
    ),
}


def videovit_config(name: str, num_classes: int, frames: int, image_size: int, **overrides) -> videovit.VideoViTConfig:
    size = name.removeprefix("videovit-")
    if size not in videovit.SIZES:
        raise ModelError(f"model {name!r}: size {size!r} is not one of {', '.join(videovit.SIZES)}")
    depth, width, heads, mlp = videovit.SIZES[size]
    base = dict(
        num_classes=num_classes,
        frames=frames,
        image_size=image_size,
        depth=depth,
        width=width,
        heads=heads,
        mlp_dim=mlp,
    )
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "tubelet" in base:
        base["tubelet"] = tuple(base["tubelet"])
    return videovit.VideoViTConfig(**base)


def architecture(name: str, num_classes: int, frames: int = 16, image_size: int = 224, **overrides) -> Architecture:
    """The architecture called ``name`` for ``num_classes`` classes and clips of ``frames`` x ``image_size``."""
    if name.startswith("videovit-"):
        cfg = videovit_config(name, num_classes, frames, image_size, **overrides)
        t, p, q = cfg.tubelet
        spec = InputSpec(frames_multiple=t, size_multiple=max(p, q), min_size=max(p, q))
        return Architecture(
            name, videovit.layer_specs(cfg), spec, splittable=True, flops=lambda: videovit.flops_per_clip(cfg)
        )
    if name in TORCHVISION:
        if overrides:
            raise ModelError(
                f"model {name!r} takes no architecture options ({', '.join(overrides)}); they apply to videovit-*"
            )
        return TORCHVISION[name](num_classes)
    raise ModelError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")


def model_names() -> list[str]:
    return [f"videovit-{s}" for s in videovit.SIZES] + list(TORCHVISION)


def create_model(
    name: str, num_classes: int, frames: int = 16, image_size: int = 224, weights: Path | None = None, **overrides
) -> nn.Sequential:
    """Build the whole model in this process; ``weights`` is a local safetensors file (never a download)."""
    model = architecture(name, num_classes, frames, image_size, **overrides).build()
    if weights is not None:
        load_weights(model, weights)
    return model


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights from safetensors; ``.pt`` only through ``torch.load(weights_only=True)``."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix in (".pt", ".pth"):
        import pickle

        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise ModelError(
                f"{path}: holds objects other than tensors, which are never unpickled; save it as .safetensors"
            ) from None
    raise ModelError(f"{path}: weights must be a .safetensors file (or .pt, loaded without unpickling code)")


def load_weights(model: nn.Module, path: Path) -> None:
    """Load weights strictly: every tensor of the model, of its shape."""
    _load(model, read_weights(path), path)


def start_from(model: nn.Sequential, path: Path) -> list[str]:
    """Load a run's starting weights; a classifier of another shape (other classes) keeps its initialisation.

    Fine-tuning a model trained on one label set for another changes only the last layer's output
    size. Training at another frame size changes the position table: a learned one is resampled over
    this model's grid, a computed one (sin-cos) is this model's own. Every other tensor must fit.
    Returns the names of the classifier's tensors left at initialisation.
    """
    state, own = read_weights(path), model.state_dict()
    learned = {name for name, _ in model.named_parameters()}
    head = f"{len(model) - 1}."
    other = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    fresh = [k for k in other if k.startswith(head) and k in learned]
    if not any(k.startswith(head) for k in state):  # an encoder without a classifier (pretraining)
        fresh = [k for k in own if k.startswith(head) and k in learned]
        state.update({k: own[k] for k in own if k.startswith(head)})
    for key in other:
        if key in fresh or key not in learned:
            state[key] = own[key]
        elif key == "0.position" and isinstance(model[0], videovit.Embedding):
            fitted = videovit.fit_positions(state[key], model[0].cfg.grid)  # trained at another frame size
            if fitted is not None:
                state[key] = fitted
    _load(model, state, path)
    return fresh


def _load(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    own = model.state_dict()
    wrong = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    if wrong:
        k = wrong[0]
        raise ModelError(
            f"{path} does not fit the model: {k} is {tuple(state[k].shape)} there and {tuple(own[k].shape)} here"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def classifier_run(path: Path) -> tuple[RunDir, RunRecord]:
    """The finished run ``path`` names and its record, refused in one line when it has no classifier to use."""
    found = RunDir.find(path)
    record = found.record()
    if record.encoder_only:
        raise ModelError(
            f"{path}: an encoder without a classifier (pretraining); fine-tune it first: "
            f"python jobs/train.py --model.weights {found.root} --data.store STORE ..."
        )
    return found, record


def load_trained(run: Path) -> tuple[nn.Sequential, RunRecord]:
    """The model a finished run ended with (a run directory, its final/ folder or its weights) and its record."""
    found, record = classifier_run(run)
    model = create_model(
        record.model, len(record.classes), record.input.frames, record.model_size, **record.model_overrides()
    )
    load_weights(model, found.weights)
    return model.eval(), record


def count_flops(model: nn.Module, frames: int, image_size: int) -> int:
    """Forward FLOPs of one clip, counted by torch's FlopCounterMode (for models without a formula)."""
    from torch.utils.flop_counter import FlopCounterMode

    clip = torch.zeros(1, frames, image_size, image_size, 3, dtype=torch.uint8)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(clip)
    return int(counter.get_total_flops())


def describe(name: str, num_classes: int = 400, frames: int = 16, image_size: int = 224) -> dict[str, object]:
    """Parameters and FLOPs per clip of a named model (the ``describe`` command)."""
    arch = architecture(name, num_classes, frames, image_size)
    if name.startswith("videovit-"):
        cfg = videovit_config(name, num_classes, frames, image_size)
        params = videovit.parameters_estimate(cfg)
        flops = videovit.flops_per_clip(cfg)
    else:
        model = arch.build()
        params = sum(p.numel() for p in model.parameters())
        flops = (
            count_flops(model, frames, image_size) if arch.input.problem(frames, image_size, image_size) is None else 0
        )
    return {
        "model": name,
        "parameters": params,
        "gflops_per_clip": flops / 1e9,
        "input": dataclasses.asdict(arch.input),
        "pipeline": arch.splittable,
    }
