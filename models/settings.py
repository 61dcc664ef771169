"""What a training run is asked to do: its settings, in sections, and the checks made before any process starts.

Every field's docstring is its ``--help`` text. :func:`check_settings` refuses
a run that cannot work (a store without the split, a model that does not fit
the clips, a layout that does not divide the ranks, a batch larger than the
split) in one line, before a job waits in the queue.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from clipforge.hpc.errors import UserError
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore

from .builders import Architecture, architecture
from .parallel import ParallelConfig, Precision


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
    weights: Path | None = None
    """Start from these weights (a local .safetensors file)."""

    def overrides(self) -> dict[str, Any]:
        keys = ("depth", "tubelet", "attention", "pool", "drop_path")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


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


@dataclasses.dataclass
class OptimSettings:
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """AdamW (torch's implementation: DeepSpeed's fused one JIT-compiles for ~40 s on CPU) or SGD with momentum."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.05
    """Weight decay."""
    warmup_steps: int = 10
    """Linear warm-up steps, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.01
    """Final learning rate as a fraction of the peak."""
    clip_grad: float = 1.0
    """Gradient norm clipping (0: off)."""

    def deepspeed_optimizer(self, fused: bool = False) -> dict[str, Any]:
        """The optimizer section of the DeepSpeed config; ``fused``: torch's one-kernel AdamW (on a GPU)."""
        if self.optimizer == "sgd":
            return {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9, "weight_decay": self.weight_decay}}
        params = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": [0.9, 0.999], "torch_adam": True}
        if fused:
            params["fused"] = True  # DeepSpeed hands what it does not know to torch.optim.AdamW
        return {"type": "AdamW", "params": params}

    def deepspeed_scheduler(self, steps: int) -> dict[str, Any]:
        """Linear warm-up, then cosine decay, over a run of ``steps`` optimizer steps."""
        return {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(steps, self.warmup_steps + 1),
                "warmup_num_steps": self.warmup_steps,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": self.min_lr_ratio,
            },
        }


@dataclasses.dataclass
class TrainSettings:
    run_dir: Path = Path("runs/train")
    """Where config, metrics, checkpoints, plots and final weights go (a shared filesystem on a cluster)."""
    steps: int = 200
    """Optimizer steps."""
    batch_per_rank: int = 8
    """Clips per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    precision: Precision = "fp32"
    """fp32, bf16, or fp16 with dynamic loss scaling."""
    eval_every: int = 50
    """Evaluate every N steps (and at the end)."""
    checkpoint_every: int = 50
    """Checkpoint every N steps (and when signalled for timeout or preemption)."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep."""
    log_every: int = 10
    """Log a progress line every N steps."""
    seed: int = 0
    """Seed of sampling, augmentation and initialisation."""
    compile: bool = False
    """Compile the model with torch.compile (through DeepSpeed's engine.compile); the first steps are slower."""
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


def check_settings(s: TrainSettings, world_size: int) -> tuple[ClipStore, Architecture]:
    """Everything that can be refused before a single process starts: store, model, input, layout, batch."""
    store = ClipStore.open(s.data.store)
    train_set = ClipDataset(store, s.data.train_split)
    ClipDataset(store, s.data.eval_split)
    frames, height, width = store.params["clip_frames"], store.params["height"], store.params["width"]
    size = s.data.crop or height
    arch = architecture(s.model.name, len(store.classes), frames, size, **s.model.overrides())
    s.parallel.check(world_size, arch.splittable, s.model.name)
    if s.data.crop is not None and s.data.crop > min(height, width):
        raise TrainError(f"crop {s.data.crop} is larger than the store's {height}x{width} frames")
    problem = arch.input.problem(frames, size, s.data.crop or width)
    if problem:
        raise TrainError(
            f"model {s.model.name} {problem} (store {s.data.store}); repack the store, change the crop or pick another "
            "model"
        )
    dp = s.parallel.data_parallel(world_size)
    if len(train_set) < s.batch_per_rank * dp:
        raise TrainError(
            f"split {s.data.train_split!r} has {len(train_set)} clips, fewer than one global batch of "
            f"{s.batch_per_rank * dp}"
        )
    if s.data.decode == "device" and store.codec != "jpeg":
        raise TrainError(
            f"data.decode=device needs a jpeg store and {s.data.store} holds {store.codec} clips; "
            "drop --data.decode or pack the store with --codec jpeg"
        )
    if s.data.shuffle_window < 1:
        raise TrainError(f"data.shuffle_window is {s.data.shuffle_window}; give a number of clips, at least 1")
    if s.steps < 1 or s.checkpoint_every < 1 or s.eval_every < 1 or s.log_every < 1:
        raise TrainError("steps, checkpoint_every, eval_every and log_every must be at least 1")
    return store, arch
