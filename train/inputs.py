"""What a job reads and what it builds from it: the model and data settings every training path shares (the
DeepSpeed trainer, the parameter server, federated clients), and :func:`resolve_inputs`, the one check of them
before anything starts: the store and its splits, the crop, the architecture and whether it takes the clips, the
architecture of the starting weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from clipforge.base.errors import UserError
from clipforge.models.builders import Architecture, architecture, start_from
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore


class TrainError(UserError):
    """A training run that cannot start as configured; the message says what to change."""


@dataclasses.dataclass
class ModelSettings:
    name: str = "videovit-tiny"
    """Model builder name (videovit-tiny ... videovit-giant, r3d_18, r2plus1d_18, mvit_v2_s, ...)."""
    depth: int | None = None
    """Override the transformer's depth (videovit-* only)."""
    tubelet: tuple[int, int, int] | None = None
    """Override the tubelet size T x H x W (videovit-* only)."""
    attention: Literal["joint", "divided"] | None = None
    """joint space-time attention, or divided (time then space) (videovit-* only)."""
    pool: Literal["mean", "cls"] | None = None
    """Mean of tokens or a class token (videovit-* only)."""
    drop_path: float | None = None
    """Stochastic depth rate (videovit-* only)."""
    position: Literal["learned", "sincos", "sincos-1d"] | None = None
    """Position codes: learned, fixed sine-cosine over (t, h, w), or VideoMAE's over the token index (videovit-*)."""
    qkv_bias: Literal["qkv", "qv"] | None = None
    """Attention input biases on q, k and v, or on q and v only as VideoMAE (videovit-* only)."""
    head_norm: Literal["tokens", "pooled"] | None = None
    """The head's norm over every token before pooling, or after mean pooling as VideoMAE's fc_norm (videovit-*)."""
    layer_scale: float | None = None
    """Layer scale on each residual branch, starting at this value; 0: none (videovit-* only)."""
    norm_eps: float | None = None
    """LayerNorm epsilon of the blocks (videovit-* only)."""
    head_norm_eps: float | None = None
    """LayerNorm epsilon of the head's norm (videovit-* only; default: norm_eps)."""
    weights: Path | None = None
    """Start from these weights: a local .safetensors file, a finished run or imported model (clipforge models
    import), whose architecture is then this run's, or a registry version as registry:NAME@VERSION_OR_ALIAS
    (fine-tuning on other classes: a classifier of another shape is left at its initialisation; an encoder from
    pretraining gets a new one)."""
    registry: str | None = None
    """The registry remote for registry: weights (a bare repository path or a URL); default $CLIPFORGE_REGISTRY."""

    def registry_reference(self) -> str | None:
        """``NAME@REF`` when the weights name a registry version, else None."""
        text = None if self.weights is None else str(self.weights)
        return text[len(REGISTRY_PREFIX) :] if text is not None and text.startswith(REGISTRY_PREFIX) else None

    def overrides(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ARCHITECTURE_KEYS if getattr(self, k) is not None}

    def adopt_start(self) -> None:
        """Starting weights with a record beside them (an imported model, a finished run) bring their architecture.

        The record's model and options fill what was not asked for; an option asked for that differs is
        refused in one line (the weights would not fit). Then ``weights`` names the weights file itself.
        """
        from clipforge.rundir import RunDir, RunDirError

        if self.weights is None or self.registry_reference() is not None:
            return
        path = Path(self.weights)
        if not path.exists():
            raise TrainError(f"--model.weights {path}: no such file or folder")
        try:
            run = RunDir.find(path)
        except RunDirError:
            if path.is_dir():
                raise TrainError(
                    f"--model.weights {path}: a folder without final/model.safetensors and final/run.json; give a "
                    "weights file, a finished run or a folder made by clipforge models import"
                ) from None
            return
        record = run.record()
        self.adopt(record.model, record.model_overrides(), str(path))
        self.weights = run.weights

    def adopt(self, model: str, overrides: dict[str, Any], source: str) -> None:
        """Take the architecture of the starting weights ``source``: ``model`` and its ``overrides`` fill what was
        not asked for; an option asked for that differs is refused in one line (the weights would not fit)."""
        if self.name != model:
            if self.name != DEFAULT_MODEL:
                raise TrainError(
                    f"--model.name {self.name}: the starting weights {source} are a {model}; drop --model.name"
                )
            self.name = model
        for key, value in overrides.items():
            if key not in ARCHITECTURE_KEYS:
                raise TrainError(f"--model.weights {source}: its architecture sets {key}, which a run cannot set")
            value = tuple(value) if isinstance(value, list) else value  # JSON and YAML have no tuples
            asked = getattr(self, key)
            if asked is None:
                setattr(self, key, value)
            elif asked != value and key != "drop_path":
                raise TrainError(
                    f"--model.{key.replace('_', '-')} {asked}: the starting weights {source} have {value}; drop it"
                )


DEFAULT_MODEL = ModelSettings.name
ARCHITECTURE_KEYS = (
    "depth",
    "tubelet",
    "attention",
    "pool",
    "drop_path",
    "position",
    "qkv_bias",
    "head_norm",
    "layer_scale",
    "norm_eps",
    "head_norm_eps",
)


@dataclasses.dataclass
class DataSettings:
    store: Path = Path("store")
    """The clip store (made by jobs/preprocess.py)."""
    train_split: str = "train"
    """Split to train on."""
    eval_split: str = "val"
    """Split to evaluate on."""
    workers: int = 1
    """DataLoader workers per rank."""
    crop: int | None = None
    """Random crop to this size for training (centre crop for evaluation); empty for none."""
    flip: bool = False
    """Random horizontal flips (wrong for left/right classes)."""
    class_balance: Literal["none", "sampler", "loss"] = "none"
    """Class imbalance: sample classes evenly, or weight the loss by inverse class frequency."""
    decode: Literal["host", "device"] = "host"
    """jpeg stores: decode in the DataLoader workers (libjpeg-turbo), or move the JPEG bytes and decode each
    batch on the training device (nvJPEG on CUDA), which needs far fewer CPU cores per GPU."""
    shuffle: Literal["global", "shards"] = "global"
    """global: a permutation of all clips each epoch; shards: shards in random order, clips shuffled within
    windows of shuffle_window neighbouring clips (far fewer shard opens and seeks: for stores of more shards
    than a reader keeps open, 64). Either way the clips of a step are a function of (seed, step)."""
    shuffle_window: int = 1024
    """Clips per shuffle window with shuffle=shards (the mixing of a shuffle buffer of that size)."""
    mixup: float = 0.0
    """Mixup: blend each clip with another of its batch, labels alike, by a weight from Beta(mixup, mixup); 0: off."""
    cutmix: float = 0.0
    """CutMix: paste a box of another clip of the batch (the same box in every frame), labels by area, the box's
    share from Beta(cutmix, cutmix); 0: off. With mixup as well, each micro-batch uses one of the two, evenly."""

    def set_but_unread(self, read: tuple[str, ...]) -> str | None:
        """The first option set away from its default that a job reading only ``read`` of these would ignore, as
        its flag and value (``--data.mixup 0.8``); None when every option set is read."""
        default = DataSettings()
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in read and value != getattr(default, field.name):
                return f"--data.{field.name.replace('_', '-')} {value}"
        return None


REGISTRY_PREFIX = "registry:"
"""``--model.weights registry:NAME@REF``: a registry version, fetched by the job (the train job composes the rooms)."""


@dataclasses.dataclass
class Inputs:
    """A job's store and splits, and the architecture that trains on them."""

    store: ClipStore
    train_set: ClipDataset
    eval_set: ClipDataset
    frames: int
    size: int
    """The side of the square the model sees: the crop, or the store's frame height."""
    arch: Architecture


def resolve_inputs(
    model: ModelSettings,
    data: DataSettings,
    build: Callable[[int, int, int], Architecture] | None = None,
    try_weights: bool = False,
) -> Inputs:
    """Open the store and the splits, check the crop, adopt the starting weights' architecture (a finished run's
    or an imported model's record; a registry version's is the job's to fetch), build the architecture and check
    that it takes the store's clips: each refused in one line, before any process starts.

    ``build(classes, frames, size)``: the architecture to train (default: the classifier ``model`` names).
    ``try_weights``: load local starting weights into the model once, so that weights that do not fit are refused
    here (for jobs whose every process builds the whole model; the DeepSpeed trainer loads them on rank 0).
    """
    model.adopt_start()
    store = ClipStore.open(data.store)
    train_set, eval_set = ClipDataset(store, data.train_split), ClipDataset(store, data.eval_split)
    frames, height, width = store.params["clip_frames"], store.params["height"], store.params["width"]
    if data.crop is not None and data.crop > min(height, width):
        raise TrainError(f"--data.crop {data.crop} is larger than the store's {height}x{width} frames")
    size = data.crop or height
    if build is None:
        arch = architecture(model.name, len(store.classes), frames, size, **model.overrides())
    else:
        arch = build(len(store.classes), frames, size)
    problem = arch.input.problem(frames, size, data.crop or width)
    if problem:
        raise TrainError(
            f"model {model.name} {problem} (store {data.store}); repack the store, change the crop or pick another "
            "model"
        )
    if try_weights and model.weights is not None and model.registry_reference() is None:
        start_from(arch.build(seed=0), Path(model.weights))  # they fit (a new head for other classes), or one line
    return Inputs(store, train_set, eval_set, frames, size, arch)
