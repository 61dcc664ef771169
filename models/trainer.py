"""Training a video classifier with DeepSpeed, from the clip store, resumable to the step.

Every choice that makes a run repeatable is made per step, not per process:
which samples a step takes (a function of seed and step), the augmentation
(a generator seeded by seed and step), dropout and drop-path (the global RNG
reseeded by seed and step). So a run resumed from a checkpoint after a
requeue computes the same losses as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from clipforge.hpc.distenv import DistEnv, setup_distributed
from clipforge.hpc.logs import Progress
from clipforge.hpc.requeue import Preemption
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore

from .builders import Architecture, ModelError, architecture
from .evaluation import evaluate_logits, plot_run
from .parallel import ParallelConfig, ParallelError, Precision, deepspeed_config

log = logging.getLogger(__name__)


class TrainError(ValueError):
    """A training run that cannot start as configured; the message says what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the last complete one, which stays valid."""


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
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


def check_settings(s: TrainSettings, world_size: int) -> tuple[ClipStore, Architecture]:
    """Everything that can be refused before a single process starts: store, model, input, layout, batch."""
    from clipforge.preprocess.store import StoreError

    try:
        store = ClipStore.open(s.data.store)
        train_set = ClipDataset(store, s.data.train_split)
        ClipDataset(store, s.data.eval_split)
    except StoreError as exc:
        raise TrainError(str(exc)) from None
    frames, height, width = store.params["clip_frames"], store.params["height"], store.params["width"]
    size = s.data.crop or height
    try:
        arch = architecture(s.model.name, len(store.classes), frames, size, **s.model.overrides())
        s.parallel.check(world_size, arch.splittable, s.model.name)
    except (ModelError, ParallelError) as exc:
        raise TrainError(str(exc)) from None
    if s.data.crop is not None and s.data.crop > min(height, width):
        raise TrainError(f"crop {s.data.crop} is larger than the store's {height}x{width} frames")
    problem = arch.input.problem(frames, size, s.data.crop or width)
    if problem:
        raise TrainError(f"model {s.model.name} {problem} (store {s.data.store}); repack the store, change the crop or pick another model")
    dp = s.parallel.data_parallel(world_size)
    if len(train_set) < s.batch_per_rank * dp:
        raise TrainError(f"split {s.data.train_split!r} has {len(train_set)} clips, fewer than one global batch of {s.batch_per_rank * dp}")
    if s.steps < 1 or s.checkpoint_every < 1 or s.eval_every < 1 or s.log_every < 1:
        raise TrainError("steps, checkpoint_every, eval_every and log_every must be at least 1")
    return store, arch


class StepSampler:
    """The sample indices of every (step, micro-batch, data-parallel rank), computed, not replayed.

    Positions run through epochs; each epoch is a permutation (or a class-balanced
    draw) seeded by (seed, epoch). Starting at any step costs nothing.
    """

    def __init__(self, labels: np.ndarray, batch: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int, balanced: bool) -> None:
        self.labels, self.batch, self.grad_accum = labels, batch, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.balanced = dp_rank, dp_size, seed, balanced
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, e])
            n = len(self.labels)
            if self.balanced:
                counts = np.bincount(self.labels)
                weights = 1.0 / counts[self.labels]
                self._epochs[e] = rng.choice(n, size=n, replace=True, p=weights / weights.sum())
            else:
                self._epochs[e] = rng.permutation(n)
            self._epochs.pop(e - 2, None)
        return self._epochs[e]

    def indices(self, step: int, micro: int) -> list[int]:
        n = len(self.labels)
        start = ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.batch
        return [int(self._epoch(p // n)[p % n]) for p in range(start, start + self.batch)]

    def batches(self, first_step: int, last_step: int) -> Iterator[list[int]]:
        for step in range(first_step, last_step):
            for micro in range(self.grad_accum):
                yield self.indices(step, micro)


class Trainer:
    """One training run: built and checked in ``__init__``, run by :meth:`train`."""

    # configuration
    settings: TrainSettings
    dist: DistEnv
    # components
    store: ClipStore
    train_set: ClipDataset
    eval_set: ClipDataset
    arch: Architecture
    engine: Any
    sampler: StepSampler
    dp_rank: int
    # runtime
    preemption: Preemption
    # state
    step: int

    def __init__(self, settings: TrainSettings, max_requeues: int = 3) -> None:
        self.settings = settings
        self.max_requeues = max_requeues
        self.dist = setup_distributed()
        self.store, self.arch = check_settings(settings, self.dist.world_size)
        self.train_set = ClipDataset(self.store, settings.data.train_split)
        self.eval_set = ClipDataset(self.store, settings.data.eval_split)
        self.step = 0

    # -- layout --------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.settings.parallel.data_parallel(self.dist.world_size)

    @property
    def is_pipeline(self) -> bool:
        return self.settings.parallel.pipeline_stages > 1

    def _clip_shape(self) -> tuple[int, int, int]:
        p = self.store.params
        return p["clip_frames"], p["height"], p["width"]

    # -- setup -----------------------------------------------------------------------
    def _build_engine(self) -> None:
        import deepspeed

        s = self.settings
        torch.manual_seed(s.seed)
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl", timeout=datetime.timedelta(minutes=10))
        has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self._probe_modules())
        config = deepspeed_config(
            s.parallel, self.dist.world_size, s.batch_per_rank, s.grad_accum, s.precision,
            self._optimizer_config(), self._scheduler_config(), s.optim.clip_grad, has_bn,
        )  # fmt: skip
        if self.is_pipeline:
            from deepspeed.pipe import LayerSpec, PipelineModule

            model = PipelineModule(
                layers=[LayerSpec(make, *args) for make, args in self.arch.layers],
                num_stages=s.parallel.pipeline_stages,
                loss_fn=self._loss,
                partition_method=s.parallel.partition_method,
                activation_checkpoint_interval=1 if s.parallel.activation_checkpointing else 0,
                seed_layers=True,
                seed_fn=torch.manual_seed,
                base_seed=s.seed,
            )
        else:
            model = self.arch.build(seed=s.seed)
            if s.model.weights is not None:
                from .builders import load_weights

                load_weights(model, s.model.weights)
            if s.parallel.activation_checkpointing:
                model = _Checkpointed(model)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
        self.dp_rank = self.engine.grid.data_parallel_id if self.is_pipeline else self.dist.rank
        self.sampler = StepSampler(self.train_set.labels, s.batch_per_rank, s.grad_accum, self.dp_rank, self.dp_size, s.seed, s.data.class_balance == "sampler")
        counts = np.bincount(self.train_set.labels, minlength=len(self.store.classes)).astype(np.float64)
        self.class_weights = torch.tensor(counts.sum() / (len(counts) * np.maximum(counts, 1)), dtype=torch.float32) if s.data.class_balance == "loss" else None

    def _probe_modules(self):
        # Layer specs build cheaply for the sizes we test; for the huge sizes only the first layers are looked at.
        for make, args in self.arch.layers[:2] + self.arch.layers[-1:]:
            yield from make(*args).modules()

    def _optimizer_config(self) -> dict[str, Any]:
        o = self.settings.optim
        if o.optimizer == "sgd":
            return {"type": "SGD", "params": {"lr": o.lr, "momentum": 0.9, "weight_decay": o.weight_decay}}
        return {"type": "AdamW", "params": {"lr": o.lr, "weight_decay": o.weight_decay, "betas": [0.9, 0.999], "torch_adam": True}}

    def _scheduler_config(self) -> dict[str, Any]:
        o, s = self.settings.optim, self.settings
        return {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(s.steps, o.warmup_steps + 1),
                "warmup_num_steps": o.warmup_steps,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": o.min_lr_ratio,
            },
        }

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = self.class_weights.to(logits.device) if self.class_weights is not None else None
        return F.cross_entropy(logits.float(), labels.long(), weight=weight)

    # -- data --------------------------------------------------------------------------
    def _loader(self, first_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches from ``first_step`` on, augmented on the device with per-step seeds."""
        s = self.settings
        loader = torch.utils.data.DataLoader(
            self.train_set,
            batch_sampler=self.sampler.batches(first_step, s.steps),
            num_workers=s.data.workers,
            persistent_workers=False,
            prefetch_factor=4 if s.data.workers else None,
        )
        device = self._device()
        for n, (clips, labels) in enumerate(loader):
            step, micro = first_step + n // s.grad_accum, n % s.grad_accum
            yield self._augment(clips.to(device), step, micro), labels.to(device)

    def _augment(self, clips: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        d = self.settings.data
        if d.crop is None and not d.flip:
            return clips
        # Seeded by data-parallel rank: the stages of one pipeline must crop their shared batch alike.
        g = torch.Generator().manual_seed(hash((self.settings.seed, step, micro, self.dp_rank)) % (2**63))
        b, _, h, w, _ = clips.shape
        out = []
        for i in range(b):
            clip = clips[i]
            if d.crop is not None:
                top = int(torch.randint(0, h - d.crop + 1, (1,), generator=g))
                left = int(torch.randint(0, w - d.crop + 1, (1,), generator=g))
                clip = clip[:, top : top + d.crop, left : left + d.crop]
            if d.flip and bool(torch.rand(1, generator=g) < 0.5):
                clip = clip.flip(2)
            out.append(clip)
        return torch.stack(out).contiguous()

    def _center_crop(self, clips: torch.Tensor) -> torch.Tensor:
        c = self.settings.data.crop
        if c is None:
            return clips
        h, w = clips.shape[2:4]
        top, left = (h - c) // 2, (w - c) // 2
        return clips[:, :, top : top + c, left : left + c].contiguous()

    def _device(self) -> torch.device:
        return torch.device("cuda", self.dist.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        s = self.settings
        s.run_dir.mkdir(parents=True, exist_ok=True)
        self._build_engine()
        self.preemption = Preemption(self.max_requeues)
        self.step = self._resume()
        writer = self._tensorboard()
        clips_per_step = s.batch_per_rank * s.grad_accum * self.dp_size
        flops = self.arch.flops() if self.arch.flops else None
        progress = Progress(s.steps - self.step, "training", unit="step", enabled=self.dist.is_main)
        batches = self._loader(self.step)
        window_start, window_steps = time.perf_counter(), 0
        while self.step < s.steps:
            torch.manual_seed(s.seed * 1_000_003 + self.step)  # dropout and drop-path repeat after a resume
            loss = self._train_step(batches)
            self.step += 1
            window_steps += 1
            if self.dist.is_main:
                self._log_train(loss, writer)
            if self.step % s.log_every == 0 or self.step == s.steps:
                elapsed = time.perf_counter() - window_start
                rate = window_steps * clips_per_step / max(elapsed, 1e-9)
                figures = {"loss": f"{loss:.4f}", "lr": f"{self._lr():.2e}", "clips/s": f"{rate:.1f}"}
                if flops:
                    figures["TFLOP/s"] = f"{3 * flops * rate / 1e12:.3f}"  # forward + backward ~ 3x forward
                progress.update(window_steps, **figures)
                window_start, window_steps = time.perf_counter(), 0
            if self.step % s.checkpoint_every == 0 and self.step < s.steps:
                self.save_checkpoint()
            if self.step % s.eval_every == 0 and self.step < s.steps and not self.is_pipeline:
                self._log_eval(self.evaluate(), writer)
            if self.preemption.requested():
                self.save_checkpoint()
                self.preemption.requeue()
        progress.close()
        self.save_checkpoint()
        result = self._finish(writer)
        return result

    def _train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if self.is_pipeline:
            return float(self.engine.train_batch(data_iter=batches).item())
        losses = []
        for _ in range(self.settings.grad_accum):
            clips, labels = next(batches)
            loss = self._loss(self.engine(clips), labels)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        if self.dp_size > 1:
            torch.distributed.all_reduce(mean)
            mean /= self.dp_size
        return float(mean.item())

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str | None = None) -> dict[str, Any]:
        """Clip- and video-level accuracy of the current weights on a split (ranks share the clips)."""
        dataset = self.eval_set if split is None else ClipDataset(self.store, split)
        mine = list(range(self.dist.rank, len(dataset), self.dist.world_size))
        self.engine.eval()
        logits, labels = [], []
        for start in range(0, len(mine), self.settings.batch_per_rank):
            batch = [dataset[i] for i in mine[start : start + self.settings.batch_per_rank]]
            clips = self._center_crop(torch.stack([c for c, _ in batch]).to(self._device()))
            logits.append(self.engine(clips).float().cpu())
            labels.extend(y for _, y in batch)
        self.engine.train()
        local = (torch.cat(logits).numpy() if logits else np.zeros((0, len(self.store.classes))), np.array(labels, np.int64), np.array(mine, np.int64))
        gathered = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, local)
        all_logits = np.concatenate([g[0] for g in gathered])
        all_labels = np.concatenate([g[1] for g in gathered])
        order = np.concatenate([g[2] for g in gathered])
        metrics = evaluate_logits(all_logits, all_labels, dataset.video_ids[order], self.store.classes)
        metrics["loss"] = float(F.cross_entropy(torch.from_numpy(all_logits), torch.from_numpy(all_labels)).item()) if len(all_labels) else 0.0
        metrics["split"] = dataset.split
        return metrics

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.settings.run_dir / "checkpoints"

    def save_checkpoint(self) -> None:
        """Save on every rank, then mark the checkpoint complete; only complete ones are ever resumed."""
        tag = f"step-{self.step:08d}"
        if (self.checkpoint_dir / tag / "complete.json").exists():
            return
        try:
            self.engine.save_checkpoint(str(self.checkpoint_dir), tag=tag, client_state={"step": self.step}, save_latest=False)
        except (OSError, RuntimeError) as exc:
            kept = next(iter(complete_checkpoints(self.checkpoint_dir)), None)
            shutil.rmtree(self.checkpoint_dir / tag, ignore_errors=True)  # never leave half a checkpoint to fill the disk
            raise CheckpointError(
                f"checkpoint {tag} could not be written to {self.checkpoint_dir}: {exc}; "
                + (f"the last complete checkpoint {kept} is intact: free space and start the job again to resume from it" if kept else "there is no earlier checkpoint")
            ) from None
        torch.distributed.barrier()
        if self.dist.is_main:
            folder = self.checkpoint_dir / tag
            files = {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
            _write_json(folder / "complete.json", {"step": self.step, "files": files})
            _write_json(self.checkpoint_dir / "latest.json", {"tag": tag})
            for old in complete_checkpoints(self.checkpoint_dir)[self.settings.keep_checkpoints :]:
                shutil.rmtree(self.checkpoint_dir / old, ignore_errors=True)
            log.info("checkpoint %s saved", tag)
        torch.distributed.barrier()

    def _resume(self) -> int:
        tag = None
        for candidate in complete_checkpoints(self.checkpoint_dir):
            problem = verify_checkpoint(self.checkpoint_dir / candidate)
            if problem is None:
                tag = candidate
                break
            if self.dist.is_main:
                log.warning("checkpoint %s is unusable (%s); trying the one before", candidate, problem)
        if tag is None:
            return 0
        _, client = self.engine.load_checkpoint(str(self.checkpoint_dir), tag=tag)
        step = int(client["step"])
        if self.dist.is_main:
            log.info("resumed from checkpoint %s at step %d (restart %d)", tag, step, self.dist.restart_count)
        return step

    # -- outputs -----------------------------------------------------------------------------------
    def _tensorboard(self):
        if not self.dist.is_main:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.settings.run_dir / "tensorboard"), purge_step=self.step or None)

    def _log_train(self, loss: float, writer) -> None:
        _append_metrics(self.settings.run_dir, {"kind": "train", "step": self.step, "loss": loss, "lr": self._lr(), "time": time.time()})
        if writer is not None:
            writer.add_scalar("train/loss", loss, self.step)
            writer.add_scalar("train/lr", self._lr(), self.step)

    def _log_eval(self, metrics: dict[str, Any], writer) -> None:
        if not self.dist.is_main:
            return
        _append_metrics(self.settings.run_dir, {"kind": "eval", "step": self.step, **metrics})
        log.info(
            "step %d: %s loss %.4f, clip top-1 %.3f, video top-1 %.3f (%d videos)",
            self.step, metrics["split"], metrics["loss"], metrics["clip_top1"], metrics["video_top1"], metrics["videos"],
        )  # fmt: skip
        if writer is not None:
            for key in ("loss", "clip_top1", "clip_top5", "video_top1", "video_top5"):
                writer.add_scalar(f"{metrics['split']}/{key}", metrics[key], self.step)

    def _finish(self, writer) -> dict[str, Any]:
        """Consolidated fp32 weights, the final evaluation, plots and what the registry needs."""
        state = self._consolidated_state()
        if self.is_pipeline:
            metrics = self._evaluate_plain(state) if self.dist.is_main else None
        else:
            metrics = self.evaluate()
        result: dict[str, Any] = {"step": self.step}
        if self.dist.is_main:
            self._log_eval(metrics, writer)
            if writer is not None:
                writer.close()
            weights = write_final(self.settings.run_dir, state, self._run_record(metrics), metrics)
            result.update(metrics=metrics, weights=str(weights))
            log.info("finished at step %d: %s video top-1 %.3f; weights in %s", self.step, metrics["split"], metrics["video_top1"], weights)
        torch.distributed.barrier()
        return result

    def _consolidated_state(self) -> dict[str, torch.Tensor]:
        """fp32 weights of the plain model, whatever the ZeRO stage or pipeline layout (rank 0; empty elsewhere)."""
        tag = f"step-{self.step:08d}"
        if self.is_pipeline:
            state: dict[str, torch.Tensor] = {}
            if self.dist.is_main:
                for path in sorted((self.checkpoint_dir / tag).glob("layer_*-model_states.pt")):
                    index = int(path.name.split("_")[1].split("-")[0])
                    for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
                        state[f"{index}.{key}"] = value.float()
            return state
        if self.settings.parallel.zero_stage == 0 and self.settings.precision == "fp32":
            return {k: v.detach().float().cpu() for k, v in self.engine.module.state_dict().items()} if self.dist.is_main else {}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if not self.dist.is_main:
            return {}
        state = get_fp32_state_dict_from_zero_checkpoint(str(self.checkpoint_dir), tag=tag)
        return {k: v.float() for k, v in state.items()}

    def _evaluate_plain(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        model = self.arch.build(seed=self.settings.seed)
        model.load_state_dict(state)
        return evaluate_model(model, self.eval_set, self.settings.batch_per_rank, self.settings.data.crop)

    def _run_record(self, metrics: dict[str, Any]) -> dict[str, Any]:
        s = self.settings
        return run_record(s.model.name, s.model.overrides(), self.store, s.data.store, s.data.crop, metrics, self.step, self.dist.world_size)


def run_record(model: str, overrides: dict[str, Any], store: ClipStore, store_path: Path, crop: int | None,
               metrics: dict[str, Any], steps: int, world_size: int) -> dict[str, Any]:  # fmt: skip
    """final/run.json: what evaluation, prediction and the registry need to know about a finished run."""
    p = store.params
    return {
        "model": model,
        "architecture": overrides,
        "classes": store.classes,
        "input": {"frames": p["clip_frames"], "height": p["height"], "width": p["width"]},
        "crop": crop,
        "store": str(store_path),
        "data_fingerprint": store_fingerprint(store_path),
        "metrics": {k: metrics[k] for k in ("clip_top1", "clip_top5", "video_top1", "video_top5", "loss")},
        "metrics_split": metrics["split"],
        "per_class_accuracy": metrics["per_class_accuracy"],
        "code_commit": _code_commit(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "steps": steps,
        "world_size": world_size,
    }


def write_final(run_dir: Path, state: dict[str, torch.Tensor], record: dict[str, Any], metrics: dict[str, Any]) -> Path:
    """The end of any run: consolidated weights, eval.json, final/run.json, the evaluation row and the plots."""
    from safetensors.torch import save_file

    final = Path(run_dir) / "final"
    final.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(final / "model.safetensors"))
    _write_json(Path(run_dir) / "eval.json", metrics)
    _write_json(final / "run.json", record)
    plot_run(Path(run_dir), record["classes"])
    return final / "model.safetensors"


def load_trained(run_or_weights: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model a run finished with, and its record (final/run.json): architecture, classes, input, metrics."""
    from .builders import create_model, load_weights

    path = Path(run_or_weights)
    final = path / "final" if (path / "final").is_dir() else path.parent if path.is_file() else path
    record_path = final / "run.json"
    if not record_path.exists():
        raise TrainError(f"{path}: no final/run.json; give a finished run directory or its final/ folder")
    record = json.loads(record_path.read_text())
    overrides = dict(record["architecture"])
    if "tubelet" in overrides:
        overrides["tubelet"] = tuple(overrides["tubelet"])
    size = record["crop"] or record["input"]["height"]
    model = create_model(record["model"], len(record["classes"]), record["input"]["frames"], size, **overrides)
    load_weights(model, final / "model.safetensors")
    return model.eval(), record


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, dataset: ClipDataset, batch: int, crop: int | None) -> dict[str, Any]:
    """Accuracy of a plain (non-distributed) model on a split, in one process."""
    model.eval()
    logits = []
    for start in range(0, len(dataset), batch):
        clips = torch.stack([dataset[i][0] for i in range(start, min(start + batch, len(dataset)))])
        if crop is not None:
            h, w = clips.shape[2:4]
            clips = clips[:, :, (h - crop) // 2 : (h - crop) // 2 + crop, (w - crop) // 2 : (w - crop) // 2 + crop]
        logits.append(model(clips.contiguous()).float())
    all_logits = torch.cat(logits).numpy() if logits else np.zeros((0, len(dataset.classes)))
    labels = dataset.labels.astype(np.int64)
    metrics = evaluate_logits(all_logits, labels, dataset.video_ids, dataset.classes)
    metrics["loss"] = float(F.cross_entropy(torch.from_numpy(all_logits), torch.from_numpy(labels)).item()) if len(labels) else 0.0
    metrics["split"] = dataset.split
    return metrics


def complete_checkpoints(folder: Path) -> list[str]:
    """Tags of checkpoints that finished saving, newest first."""
    if not folder.is_dir():
        return []
    return sorted((p.parent.name for p in folder.glob("step-*/complete.json")), reverse=True)


def verify_checkpoint(folder: Path) -> str | None:
    """Why a complete checkpoint cannot be used (a file missing or changed), or None."""
    try:
        record = json.loads((folder / "complete.json").read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable completion record: {exc}"
    for name, digest in record["files"].items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


def store_fingerprint(store: Path) -> dict[str, Any]:
    """What identifies the data a model saw: format version, index checksum, classes."""
    s = ClipStore.open(store)
    return {"format_version": 1, "index_sha256": _sha256(Path(store) / "index.h5"), "classes": s.classes, "params": s.params}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row, default=float) + "\n")


def _code_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


class _Checkpointed(torch.nn.Sequential):
    """Activation checkpointing for a plain model: recompute each layer's activations in backward."""

    def __init__(self, model: torch.nn.Sequential) -> None:
        super().__init__(*model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self:
            x = checkpoint(layer, x, use_reentrant=False) if self.training and any(p.requires_grad for p in layer.parameters()) else layer(x)
        return x
