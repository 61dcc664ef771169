"""Published checkpoints in: VideoMAE and VideoMAE V2 ``.pth`` files, Hugging Face VideoMAE folders, torchvision.

``clipforge models import PATH --from videomae|videomaev2|hf|torchvision --name NAME``
turns a downloaded checkpoint into what a run ends with: ``NAME/final/model.safetensors``
and ``NAME/final/run.json`` (the architecture and its classes), so ``--model.weights
NAME`` fine-tunes it and ``clipforge registry push NAME`` versions it.

Each format's keys are mapped one by one onto the layers of :mod:`.videovit` (or
the torchvision model clipforge builds), and every key must find its place: a
key that cannot be mapped, or a tensor of the wrong shape, is refused in one line
naming it. Nothing is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from clipforge.base.files import update_sha256

from . import videovit
from .builders import TORCHVISION, ModelError, architecture

FORMATS = ("videomae", "videomaev2", "hf", "torchvision")

# The parts of a VideoMAE pretraining checkpoint that are not the encoder: its decoder, left behind.
_PRETRAIN_ONLY = re.compile(r"^(decoder\.|encoder_to_decoder\.|mask_token$|encoder\.norm\.|norm\.)")


@dataclasses.dataclass
class Imported:
    """A checkpoint mapped onto a clipforge model: its weights, how to build it, what it classifies."""

    model: str
    overrides: dict[str, Any]
    classes: list[str]
    frames: int
    image_size: int
    state: dict[str, torch.Tensor]
    encoder_only: bool
    """A pretraining checkpoint's encoder: no classifier, fine-tuned with --model.weights before use."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What was left behind, in words."""


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a ``.pth``: under ``model``, ``module`` or ``state_dict``, or the file itself.

    ``weights_only=True`` throughout; VideoMAE's training checkpoints also hold their argparse
    Namespace, which is allowed as the one non-tensor object (it is a plain attribute bag).
    """
    import argparse
    import pickle

    try:
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice to rerun with weights_only=False: never here
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{path}: not a checkpoint loadable without running code ({first[:160]})") from None
    for key in ("model", "module", "state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ModelError(f"{path}: holds no state dict (a mapping of names to tensors under model, module or itself)")
    return dict(data)


# -- VideoMAE and VideoMAE V2 -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How a format names videovit's tensors: prefixes of whole layers, and the names inside a block."""

    source: str
    prefixes: dict[str, str]
    """A key's prefix and what replaces it; ``{head}`` is the head's layer index (depth + 1)."""
    block: str
    """A block's keys: a pattern with groups ``i`` (its index), ``name`` and ``rest`` (.weight, .bias or none)."""
    names: dict[str, str]
    """A name inside a block and videovit's name for it."""

    def place(self, key: str, depth: int) -> str:
        """Where ``key`` goes in videovit's layers (``0.`` embedding, ``i + 1.`` block i, ``depth + 1.`` head)."""
        for prefix, target in self.prefixes.items():
            if key.startswith(prefix):
                return target.format(head=depth + 1) + key[len(prefix) :]
        match = re.fullmatch(self.block, key)
        if match and match["name"] in self.names:
            return f"{int(match['i']) + 1}.{self.names[match['name']]}{match['rest'] or ''}"
        raise ModelError(f"{key}: no place for it in videovit (a {self.source} feature clipforge does not build)")


VIDEOMAE = KeyMap(
    "VideoMAE",
    {"patch_embed.proj.": "0.proj.", "pos_embed": "0.position", "fc_norm.": "{head}.norm.", "head.": "{head}.fc."},
    r"blocks\.(?P<i>\d+)\.(?P<name>.+?)(?P<rest>\.weight|\.bias)?",
    {
        "norm1": "norm1",
        "attn.qkv": "attn.qkv",
        "attn.q_bias": "attn.q_bias",
        "attn.v_bias": "attn.v_bias",
        "attn.proj": "attn.proj",
        "norm2": "norm2",
        "mlp.fc1": "mlp.0",
        "mlp.fc2": "mlp.2",
        "gamma_1": "gamma_1",
        "gamma_2": "gamma_2",
    },
)


def from_videomae(
    state: dict[str, torch.Tensor], frames: int = 16, image_size: int = 224, heads: int | None = None
) -> Imported:
    """VideoMAE (and V2) keys: ``patch_embed``, ``blocks.i``, ``fc_norm``, ``head``; ``encoder.*`` from pretraining."""
    notes = []
    encoder_only = any(k.startswith("encoder.") for k in state)
    if encoder_only:
        left = sorted({k.split(".")[0] for k in state if _PRETRAIN_ONLY.match(k)})
        if left:
            notes.append(f"left behind: the pretraining's {', '.join(left)} (the decoder and the encoder's last norm)")
        state = {k.removeprefix("encoder."): v for k, v in state.items() if not _PRETRAIN_ONLY.match(k)}
    if "patch_embed.proj.weight" not in state:
        raise ModelError("no patch_embed.proj.weight: not a VideoMAE checkpoint (try --from hf or --from torchvision)")
    proj = state["patch_embed.proj.weight"]
    width, tubelet = proj.shape[0], tuple(proj.shape[2:])
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    mlp = state["blocks.0.mlp.fc1.weight"].shape[0]
    if "blocks.0.attn.q_bias" in state:
        bias = "qv"
    elif "blocks.0.attn.qkv.bias" in state:
        bias = "qkv"
    else:
        raise ModelError("blocks.0.attn: no q/v or qkv bias; clipforge's attention has one of the two")
    if not encoder_only and "fc_norm.weight" not in state:
        raise ModelError(
            "norm.weight without fc_norm: a classifier on the first token (use_mean_pooling off) has no clipforge "
            "equivalent; import its pretraining checkpoint instead"
        )
    size, heads = _size_of(width, heads)
    grid = (frames // tubelet[0]) * (image_size // tubelet[1]) * (image_size // tubelet[2])
    overrides: dict[str, Any] = {"depth": depth, "tubelet": list(tubelet), "qkv_bias": bias, "norm_eps": 1e-6}
    overrides.update(head_norm="pooled", position="sincos-1d")
    if "pos_embed" in state:
        if state["pos_embed"].shape[1] != grid:
            raise ModelError(
                f"pos_embed: {state['pos_embed'].shape[1]} positions, not the {grid} tokens of {frames} frames of "
                f"{image_size} px; pass the --frames and --image-size it was trained at"
            )
        overrides["position"] = "learned"
    if "blocks.0.gamma_1" in state:
        overrides["layer_scale"] = 0.1  # the weights carry the trained scales; this is only their initial value
    _check_size(size, heads, mlp, overrides)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        out[VIDEOMAE.place(key, depth)] = value
    classes = [] if encoder_only else [f"class-{i:03d}" for i in range(state["head.weight"].shape[0])]
    return Imported(f"videovit-{size}", overrides, classes, frames, image_size, out, encoder_only, notes)


# -- Hugging Face transformers -----------------------------------------------------------------------------------
HUGGING_FACE = KeyMap(
    "transformers VideoMAE",
    {"embeddings.patch_embeddings.projection.": "0.proj.", "fc_norm.": "{head}.norm.", "classifier.": "{head}.fc."},
    r"encoder\.layer\.(?P<i>\d+)\.(?P<name>.+?)(?P<rest>\.weight|\.bias)",
    {
        "attention.output.dense": "attn.proj",
        "layernorm_before": "norm1",
        "layernorm_after": "norm2",
        "intermediate.dense": "mlp.0",
        "output.dense": "mlp.2",
    },
)


def from_hf(folder: Path) -> Imported:
    """A ``transformers`` VideoMAE folder: ``config.json`` and its safetensors (classifier, model or pretraining)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not config_path.exists() or not files:
        raise ModelError(f"{folder}: a Hugging Face folder has config.json and *.safetensors; this one lacks one")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "videomae":
        raise ModelError(f"{config_path}: model_type {config.get('model_type')!r}; the importer reads videomae")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ModelError(f"{config_path}: hidden_act {config['hidden_act']!r}; videovit's MLP uses exact GELU")
    if not config.get("use_mean_pooling", True):
        raise ModelError(
            f"{config_path}: use_mean_pooling false pools the first token, which videovit does not do; import the "
            "model's pretraining folder instead"
        )
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    encoder_only = not any(k.startswith(("classifier.", "fc_norm.")) for k in state)
    notes = []
    left = sorted({k.split(".")[0] for k in state if k.startswith(("decoder.", "encoder_to_decoder", "mask_token"))})
    if left:
        notes.append(f"left behind: the pretraining's {', '.join(left)}")
    state = {k.removeprefix("videomae."): v for k, v in state.items() if k.split(".")[0] not in left}

    depth, width = config["num_hidden_layers"], config["hidden_size"]
    patch, tubelet_t = config.get("patch_size", 16), config.get("tubelet_size", 2)
    image_size, frames = config.get("image_size", 224), config.get("num_frames", 16)
    size, heads = _size_of(width, config["num_attention_heads"])
    qv = config.get("qv_bias", config.get("qkv_bias", True))
    overrides: dict[str, Any] = {"depth": depth, "tubelet": [tubelet_t, patch, patch], "qkv_bias": "qv"}
    # transformers' fc_norm is nn.LayerNorm(hidden) at torch's default epsilon, the blocks use layer_norm_eps.
    overrides.update(head_norm="pooled", position="sincos-1d", norm_eps=config.get("layer_norm_eps", 1e-12))
    overrides["head_norm_eps"] = 1e-5
    _check_size(size, heads, config.get("intermediate_size", 4 * width), overrides)

    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        prefix = f"encoder.layer.{i}.attention.attention."
        q, k, v = (state.pop(f"{prefix}{n}.weight", None) for n in ("query", "key", "value"))
        if q is None or k is None or v is None:
            raise ModelError(f"{prefix}query/key/value.weight: missing from {folder}")
        out[f"{i + 1}.attn.qkv.weight"] = torch.cat([q, k, v])
        q_bias = state.pop(f"{prefix}query.bias", state.pop(f"{prefix}q_bias", None))
        v_bias = state.pop(f"{prefix}value.bias", state.pop(f"{prefix}v_bias", None))
        if qv and (q_bias is None or v_bias is None):
            raise ModelError(f"{prefix}query.bias/value.bias: missing, though config.json says qv_bias")
        out[f"{i + 1}.attn.q_bias"] = q_bias if q_bias is not None else torch.zeros(width)
        out[f"{i + 1}.attn.v_bias"] = v_bias if v_bias is not None else torch.zeros(width)
    for key, value in state.items():
        out[HUGGING_FACE.place(key, depth)] = value
    labels = config.get("id2label") or {}
    classes = (
        []
        if encoder_only
        else [labels.get(str(i), f"class-{i:03d}") for i in range(out[f"{depth + 1}.fc.weight"].shape[0])]
    )
    return Imported(f"videovit-{size}", overrides, classes, frames, image_size, out, encoder_only, notes)


# -- torchvision -----------------------------------------------------------------------------------------------
def from_torchvision(state: dict[str, torch.Tensor], model: str, frames: int, image_size: int) -> Imported:
    """A torchvision video model's state dict onto the same model as clipforge builds it (its parts as layers)."""
    if model not in TORCHVISION:
        raise ModelError(f"--model {model!r}: torchvision imports need one of {', '.join(TORCHVISION)}")
    head = next((k for k in ("fc.weight", "head.1.weight", "classifier.1.weight") if k in state), None)
    if head is None:
        raise ModelError(f"no classifier (fc, head.1 or classifier.1) in the state dict: not a torchvision {model}")
    classes = state[head].shape[0]
    arch = architecture(model, classes, frames, image_size)
    index = {args[2]: i for i, (_, args) in enumerate(arch.layers) if len(args) == 3 and isinstance(args[2], str)}
    parts = list(index)
    out = {}
    for key, value in state.items():
        if "" in index:
            out[f"{index['']}.{key}"] = value
            continue
        part = key.split(".")[0]
        if part not in parts:
            raise ModelError(f"{key}: no part {part!r} in clipforge's {model} ({', '.join(parts)})")
        out[f"{index[part]}.{key.split('.', 1)[1]}"] = value
    return Imported(model, {}, [f"class-{i:03d}" for i in range(classes)], frames, image_size, out, False)


# -- the command -------------------------------------------------------------------------------------------------
def import_checkpoint(
    path: Path,
    source: str,
    out: Path,
    model: str | None = None,
    frames: int | None = None,
    image_size: int | None = None,
    heads: int | None = None,
    classes: Path | None = None,
) -> tuple[Path, Imported]:
    """Import ``path`` (format ``source``) into the run-like folder ``out``; returns its weights and the import."""
    from clipforge.rundir import RunDir, RunRecord
    from clipforge.rundir.record import InputShape

    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or folder")
    if source not in FORMATS:
        raise ModelError(f"--from {source!r}: choose one of {', '.join(FORMATS)}")
    if source == "hf":
        imported = from_hf(path)
    elif source == "torchvision":
        if model is None:
            raise ModelError("--from torchvision needs --model (r2plus1d_18, mvit_v2_s, ...): state dicts do not say")
        imported = from_torchvision(load_checkpoint(path), model, frames or 16, image_size or 112)
    else:
        imported = from_videomae(load_checkpoint(path), frames or 16, image_size or 224, heads)
    if classes is not None:
        names = [line.strip() for line in Path(classes).read_text().splitlines() if line.strip()]
        if len(names) != len(imported.classes):
            raise ModelError(f"{classes}: {len(names)} class names for a classifier of {len(imported.classes)}")
        imported.classes = names
    _check_fits(imported, path)
    run = RunDir(out)
    if run.is_finished():
        raise ModelError(f"{out}: already holds a model; pick another --name or --out")
    record = RunRecord(
        model=imported.model,
        architecture=imported.overrides,
        classes=imported.classes,
        input=InputShape(imported.frames, imported.image_size, imported.image_size),
        crop=None,
        store="",
        data_fingerprint={},
        metrics={},
        metrics_split="",
        per_class_accuracy={},
        steps=0,
        world_size=1,
        imported={
            "from": source,
            "path": str(path.resolve()),
            "sha256": _sha256(path),
            "encoder_only": imported.encoder_only,
        },
    )
    return run.write_imported(imported.state, record), imported


def _check_fits(imported: Imported, path: Path) -> None:
    """Every mapped tensor has its place and shape in the model clipforge builds; only a missing head may be."""
    from .builders import _load

    arch = architecture(
        imported.model,
        max(len(imported.classes), 1),
        imported.frames,
        imported.image_size,
        **{k: tuple(v) if k == "tubelet" else v for k, v in imported.overrides.items()},
    )
    model = arch.build()
    own = model.state_dict()
    if imported.encoder_only:
        head = f"{len(model) - 1}."
        state = {**{k: v for k, v in own.items() if k.startswith(head)}, **imported.state}
    else:
        state = imported.state
    _load(model, state, path)


def _size_of(width: int, heads: int | None) -> tuple[str, int]:
    for size, (_, w, h, _) in videovit.SIZES.items():
        if w == width:
            return size, heads or h
    known = ", ".join(f"{s} {w}" for s, (_, w, _, _) in videovit.SIZES.items())
    raise ModelError(f"embedding width {width} is none of videovit's sizes ({known})")


def _check_size(size: str, heads: int, mlp: int, overrides: dict[str, Any]) -> None:
    _, width, own_heads, own_mlp = videovit.SIZES[size]
    if heads != own_heads or mlp != own_mlp:
        raise ModelError(
            f"width {width} with {heads} heads and an MLP of {mlp}: videovit-{size} has {own_heads} heads and {own_mlp}"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            update_sha256(digest, file)
    return digest.hexdigest()
