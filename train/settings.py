"""What a training run is asked to do: its settings, in sections, and the checks made before any process starts.

Every field's docstring is its ``--help`` text. :func:`resolve_settings` refuses
a run that cannot work (a store without the split, a model that does not fit
the clips, a layout that does not divide the ranks, a batch larger than the
split) in one line, before a job waits in the queue.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from clipforge.models.builders import Architecture
from clipforge.models.mae import MaeSettings
from clipforge.preprocess.store import ClipStore

from .inputs import REGISTRY_PREFIX, DataSettings, ModelSettings, TrainError, resolve_inputs
from .objectives import objective_of
from .parallel import ParallelConfig, Precision, global_batch


@dataclasses.dataclass
class OptimSettings:
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """AdamW (torch's implementation: DeepSpeed's fused one JIT-compiles for ~40 s on CPU) or SGD with momentum."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.05
    """Weight decay."""
    beta2: float = 0.999
    """AdamW's second-moment decay (VideoMAE's pretraining: 0.95)."""
    warmup_steps: int = 10
    """Linear warm-up steps, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.01
    """Final learning rate as a fraction of the peak."""
    clip_grad: float = 1.0
    """Gradient norm clipping (0: off)."""
    warmup_epochs: float | None = None
    """Linear warm-up over this many epochs of the train split instead of warmup_steps."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy (0: off; 0.1 in ViT, VideoMAE and MViT recipes)."""
    layer_decay: float = 1.0
    """Layer-wise learning-rate decay (videovit-*): layer i of the L layers (embedding, blocks, head) learns at
    lr x layer_decay^(L-1-i), so the head gets the full rate; 1: off (VideoMAE fine-tunes ViT-B with 0.75)."""

    def deepspeed_optimizer(self, fused: bool = False) -> dict[str, Any]:
        """The optimizer section of the DeepSpeed config; ``fused``: torch's one-kernel AdamW (on a GPU)."""
        if self.optimizer == "sgd":
            return {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9, "weight_decay": self.weight_decay}}
        params = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": [0.9, self.beta2], "torch_adam": True}
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
    epochs: float | None = None
    """Train for this many passes over the train split instead of a number of steps: steps becomes
    ceil(epochs x clips / global batch), worked out before the job is submitted."""
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
    preemption_poll_s: float = 10.0
    """About this many seconds of training at most between the ranks' checks for a preemption notice (Slurm's USR2,
    sent --signal-delay-s before the kill; it must cover this and a checkpoint's save). Where --log-every steps take
    longer, a check ends the log window early: after as many steps as take this long at the last window's rate."""
    seed: int = 0
    """Seed of sampling, augmentation and initialisation."""
    bf16_mode: Literal["auto", "autocast", "weights"] = "auto"
    """With --precision bf16: autocast (fp32 weights under torch.autocast, the fastest step), weights (bf16 weights
    with fp32 masters, half the memory), or auto: weights for ZeRO-3, offload, pipelines and models of 300 M
    parameters and more, autocast otherwise."""
    compile: bool | None = None
    """Compile the model with torch.compile (through DeepSpeed's engine.compile); default: on a GPU, not on CPUs.
    The first steps are slower; a graph that fails to compile runs eagerly."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS workspace, the deterministic
    flash-attention backward): a resumed run then repeats an uninterrupted one bit for bit on a GPU as on CPUs,
    at some cost in speed."""
    objective: Literal["classify", "mae"] = "classify"
    """classify: cross-entropy on the labels; mae: masked-autoencoder pretraining of a videovit-* encoder on the
    clips alone (labels ignored), ending with encoder weights that --model.weights fine-tunes."""
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    mae: MaeSettings = dataclasses.field(default_factory=MaeSettings)


def resolve_settings(s: TrainSettings, world_size: int) -> tuple[ClipStore, Architecture]:
    """Refuse what cannot work before a single process starts (store, model, input, layout, batch), and fill in
    what depends on the store and the starting weights.

    It changes ``s``: the starting weights' record brings its architecture (:meth:`ModelSettings.adopt_start`),
    and ``epochs`` / ``optim.warmup_epochs`` become ``steps`` / ``optim.warmup_steps``.
    """
    objective = objective_of(s)
    problem = objective.problem(s)
    if problem:
        raise TrainError(problem)
    inputs = resolve_inputs(
        s.model, s.data, lambda classes, frames, size: objective.architecture(s, classes, frames, size)
    )
    store, train_set, arch = inputs.store, inputs.train_set, inputs.arch
    s.parallel.check(world_size, arch.splittable, s.model.name)
    dp = s.parallel.data_parallel(world_size)
    if len(train_set) < global_batch(s.batch_per_rank, 1, dp):
        raise TrainError(
            f"split {s.data.train_split!r} has {len(train_set)} clips, fewer than one global batch of "
            f"{global_batch(s.batch_per_rank, 1, dp)}"
        )
    if s.data.decode == "device" and store.codec != "jpeg":
        raise TrainError(
            f"data.decode=device needs a jpeg store and {s.data.store} holds {store.codec} clips; "
            "drop --data.decode or pack the store with --codec jpeg"
        )
    if s.data.shuffle_window < 1:
        raise TrainError(f"data.shuffle_window is {s.data.shuffle_window}; give a number of clips, at least 1")
    _check_recipe_knobs(s)
    steps_of_epochs(s, len(train_set), global_batch(s.batch_per_rank, s.grad_accum, dp))
    if s.steps < 1 or s.checkpoint_every < 1 or s.eval_every < 1 or s.log_every < 1:
        raise TrainError("steps, checkpoint_every, eval_every and log_every must be at least 1")
    if not s.preemption_poll_s > 0:
        raise TrainError(f"--preemption-poll-s {s.preemption_poll_s}: give a number of seconds above 0")
    return store, arch


def steps_of_epochs(s: TrainSettings, clips: int, global_batch: int) -> None:
    """``epochs`` and ``optim.warmup_epochs``, where given, become ``steps`` and ``optim.warmup_steps`` of
    ``global_batch`` clips over a split of ``clips``."""
    if s.epochs is not None:
        s.steps = math.ceil(s.epochs * clips / global_batch)
    if s.optim.warmup_epochs is not None:
        s.optim.warmup_steps = round(s.optim.warmup_epochs * clips / global_batch)


def _check_recipe_knobs(s: TrainSettings) -> None:
    if s.epochs is not None and not s.epochs > 0:
        raise TrainError(f"epochs is {s.epochs}; give a positive number of passes over the train split")
    if s.optim.warmup_epochs is not None and s.optim.warmup_epochs < 0:
        raise TrainError(f"optim.warmup_epochs is {s.optim.warmup_epochs}; give 0 or more")
    if not 0 <= s.optim.label_smoothing < 1:
        raise TrainError(f"optim.label_smoothing is {s.optim.label_smoothing}; give a value in [0, 1)")
    if s.data.mixup < 0 or s.data.cutmix < 0:
        raise TrainError("data.mixup and data.cutmix are Beta parameters: give 0 (off) or a positive value")
    if not 0 < s.optim.layer_decay <= 1:
        raise TrainError(f"optim.layer_decay is {s.optim.layer_decay}; give a value in (0, 1], 1 for none")
    if s.optim.layer_decay != 1 and not s.model.name.startswith("videovit"):
        raise TrainError(
            f"optim.layer_decay needs the layers of a videovit-* model; {s.model.name} is one opaque layer"
        )
    weights = s.model.weights
    if weights is not None and s.parallel.layout == "pipeline":
        raise TrainError("model.weights: starting weights load into the plain layout; drop --parallel.layout")
    if weights is not None and not str(weights).startswith(REGISTRY_PREFIX) and not Path(weights).is_file():
        raise TrainError(f"model.weights: {weights} is not a file; give a .safetensors file or registry:NAME@REF")
