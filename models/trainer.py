"""Training a video classifier with DeepSpeed, from the clip store, resumable to the step.

Every choice that makes a run repeatable is made per step, not per process:
which samples a step takes (a function of seed and step), the augmentation
(a generator seeded by seed and step), dropout and drop-path (the global RNG
reseeded by seed and step). So a run resumed from a checkpoint after a
requeue computes the same losses as one that never stopped.

This module is the loop only. What the run is asked to do is in
:mod:`.settings`, which clips a step takes in :mod:`.sampler`, how the engine
holds the model (plain or pipeline) in :mod:`.layout`, checkpoints in
:mod:`.checkpointing`, and where everything is written in
:class:`clipforge.rundir.RunDir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from clipforge.hpc.accelerator import peak
from clipforge.hpc.distenv import DistEnv, collective_device, setup_distributed, task_device
from clipforge.hpc.errors import UserError
from clipforge.hpc.lock import WriterBusy, WriterLock
from clipforge.hpc.logs import Progress
from clipforge.hpc.requeue import Preemption
from clipforge.preprocess.reader import ClipDataset, collate_encoded
from clipforge.preprocess.store import ClipStore, decode_jpeg_batch
from clipforge.rundir import CheckpointIndex, RunDir, RunRecord

from .builders import Architecture
from .checkpointing import Checkpointer
from .clips import mix_batch, random_crop_flip
from .evaluation import evaluate_on_ranks
from .layout import LAYOUTS, EngineLayout
from .parallel import deepspeed_config
from .sampler import StepSampler
from .settings import TrainError, TrainSettings, check_settings
from .throughput import Throughput

log = logging.getLogger(__name__)

EVAL_FIGURES = ("loss", "clip_top1", "clip_top5", "video_top1", "video_top5")


class Trainer:
    """One training run: built and checked in ``__init__``, run by :meth:`train`."""

    settings: TrainSettings
    dist: DistEnv
    run: RunDir
    store: ClipStore
    train_set: ClipDataset
    eval_set: ClipDataset
    arch: Architecture
    layout: EngineLayout
    engine: Any
    sampler: StepSampler
    checkpointer: Checkpointer
    throughput: Throughput
    step: int

    def __init__(
        self,
        settings: TrainSettings,
        max_requeues: int = 3,
        elastic: bool = False,
        fetch_weights: Callable[[Path], Path] | None = None,
    ) -> None:
        self.settings = settings
        self.max_requeues = max_requeues
        self.elastic = elastic
        """Whether a resume may find another number of data-parallel ranks than the checkpoint's writers."""
        self.fetch_weights = fetch_weights
        """Rank 0 copies the starting weights into the folder it is given and returns their file (registry weights)."""
        self._reshard_from: str | None = None
        self.dist = setup_distributed()
        asked = settings.steps
        self.store, self.arch = check_settings(settings, self.dist.world_size)
        if settings.epochs is not None and self.dist.is_main:
            log.info(
                "%g epochs of the %r split: %d steps (not %d)",
                settings.epochs,
                settings.data.train_split,
                settings.steps,
                asked,
            )
        self.train_set = ClipDataset(self.store, settings.data.train_split, encoded=settings.data.decode == "device")
        self.eval_set = ClipDataset(self.store, settings.data.eval_split)
        self.run = RunDir(settings.run_dir)
        self.layout = LAYOUTS[settings.parallel.layout]()
        self.class_weights: torch.Tensor | None = None
        self.step = 0

    @property
    def dp_size(self) -> int:
        return self.settings.parallel.data_parallel(self.dist.world_size)

    @property
    def checkpoints(self) -> CheckpointIndex:
        return self.run.checkpoints

    @functools.cached_property
    def device(self) -> torch.device:
        return task_device(self.dist)

    # -- setup -----------------------------------------------------------------------
    def _build_engine(self) -> None:
        import deepspeed

        s = self.settings
        torch.manual_seed(s.seed)
        self._universal_tag = self._universal_checkpoint()
        if s.data.class_balance == "loss":
            counts = np.bincount(self.train_set.labels, minlength=len(self.store.classes)).astype(np.float64)
            self.class_weights = torch.tensor(counts.sum() / (len(counts) * np.maximum(counts, 1)), dtype=torch.float32)
        config = deepspeed_config(
            s.parallel,
            self.dist.world_size,
            s.batch_per_rank,
            s.grad_accum,
            s.precision,
            s.optim.deepspeed_optimizer(fused=self.device.type == "cuda" and not s.parallel.offload_optimizer),
            s.optim.deepspeed_scheduler(s.steps),
            s.optim.clip_grad,
            self._has_batchnorm(),
            load_universal=self._reshard_from is not None,
        )
        model = self.layout.module(self)
        groups = parameter_groups(model, len(self.arch.layers), s.optim.lr, s.optim.layer_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        if s.compile:
            self.engine.compile()
        self.dp_rank = self.layout.data_parallel_rank(self)
        balanced = s.data.class_balance == "sampler"
        local = s.data.shuffle == "shards"
        self.sampler = StepSampler(
            self.train_set.labels,
            s.batch_per_rank,
            s.grad_accum,
            self.dp_rank,
            self.dp_size,
            s.seed,
            balanced,
            shards=self.train_set.shards if local else None,
            positions=self.train_set.positions if local else None,
            window=s.data.shuffle_window if local else 0,
        )
        layout = {
            "world_size": self.dist.world_size,
            "data_parallel": self.dp_size,
            "global_batch": s.batch_per_rank * s.grad_accum * self.dp_size,
        }
        self.checkpointer = Checkpointer(self.engine, self.checkpoints, self.dist, s.keep_checkpoints, layout)

    def _fit_to_checkpoint(self) -> None:
        """A resumed run keeps its global batch: on fewer (or more) data-parallel ranks, by its gradient accumulation.

        Only when the job allows it (``--elastic-min-nodes``), and only for layouts whose state DeepSpeed
        can cut again: ZeRO 0-2 data parallel (a pipeline needs its stage count, ZeRO-3 its partitions).
        """
        newest = next(iter(self.checkpoints.complete()), None)
        written = self.checkpoints.layout(newest) if newest else None
        if not written:
            return
        s, was, now = self.settings, written["data_parallel"], self.dp_size
        if was == now:
            return
        if not self.elastic:
            raise TrainError(
                f"checkpoint {newest} was written by {was} data-parallel ranks and this job has {now}: run it on "
                f"{was}, or start the run with --elastic-min-nodes to allow a restart on fewer nodes"
            )
        if s.parallel.layout != "plain" or s.parallel.zero_stage == 3:
            raise TrainError(
                f"checkpoint {newest} was written by {was} ranks and this job has {now}: an elastic restart "
                "reshards ZeRO 0-2 data parallel only (a pipeline needs its stages, ZeRO-3 its partitions)"
            )
        per_micro_batch = s.batch_per_rank * now
        if written["global_batch"] % per_micro_batch:
            raise TrainError(
                f"the run's global batch of {written['global_batch']} clips does not divide over {now} ranks of "
                f"{s.batch_per_rank}; restart it on a number of ranks that divides it"
            )
        grad_accum = written["global_batch"] // per_micro_batch
        if self.dist.is_main:
            log.warning(
                "checkpoint %s was written by %d data-parallel ranks, this job has %d: gradient accumulation %d -> "
                "%d keeps the global batch of %d clips",
                newest,
                was,
                now,
                s.grad_accum,
                grad_accum,
                written["global_batch"],
            )
        self.settings = dataclasses.replace(s, grad_accum=grad_accum)
        if s.parallel.zero_stage > 0:
            self._reshard_from = newest  # ZeRO's optimizer partitions are cut per rank: reshard them

    def _fetch_start_weights(self) -> None:
        """Rank 0 copies registry weights into the run directory, once; every rank then starts from that file.

        A run that resumes from a checkpoint needs no starting weights and fetches nothing.
        """
        if self.fetch_weights is None or next(iter(self.checkpoints.complete()), None) is not None:
            return
        found: list[Any] = [None]
        if self.dist.is_main:
            try:
                found = [str(self.fetch_weights(self.run.start_weights))]
            except UserError as exc:
                found = [TrainError(str(exc))]
        torch.distributed.broadcast_object_list(found, src=0, device=collective_device())
        if isinstance(found[0], Exception):
            raise found[0]
        self.settings.model.weights = Path(found[0])

    def _universal_checkpoint(self) -> str | None:
        """Convert the checkpoint to resume from into DeepSpeed's universal form (rank 0; the others wait)."""
        if self._reshard_from is None:
            return None
        tag = f"{self._reshard_from}-universal"
        target = self.checkpoints.path(tag)
        if self.dist.is_main and not target.exists():
            partial = target.with_name(tag + ".partial")
            command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"]
            command += ["--input_folder", str(self.checkpoints.path(self._reshard_from)), "--output_folder"]
            command += [str(partial), "--num_extract_workers", "1", "--num_merge_workers", "1"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise TrainError(
                    f"checkpoint {self._reshard_from} could not be resharded for {self.dp_size} ranks: "
                    f"{(result.stderr.strip().splitlines() or ['no message'])[-1]}"
                )
            partial.rename(target)
            log.info("checkpoint %s resharded (universal form in %s)", self._reshard_from, target)
        torch.distributed.barrier()
        return tag

    def _has_batchnorm(self) -> bool:
        # Layer specs build cheaply at the sizes we test; at the huge sizes only the first and
        # last layers are looked at.
        for make, args in self.arch.layers[:2] + self.arch.layers[-1:]:
            if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in make(*args).modules()):
                return True
        return False

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy against class indices, or against soft targets ``[B, classes]`` (mixup, CutMix)."""
        weight = self.class_weights.to(logits.device) if self.class_weights is not None else None
        target = labels.float() if labels.is_floating_point() else labels.long()
        return F.cross_entropy(
            logits.float(), target, weight=weight, label_smoothing=self.settings.optim.label_smoothing
        )

    # -- data --------------------------------------------------------------------------
    def _batches(self, first_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches from ``first_step`` on, augmented on the device with per-step seeds.

        uint8 clips travel to a GPU from pinned memory without blocking the host; the model
        normalises them there (its first layer), so the copy is a quarter of a float one.
        """
        s = self.settings
        cuda = self.device.type == "cuda"
        loader = torch.utils.data.DataLoader(
            self.train_set,
            batch_sampler=self.sampler.batches(first_step, s.steps),
            num_workers=s.data.workers,
            persistent_workers=False,
            prefetch_factor=4 if s.data.workers else None,
            pin_memory=cuda and not self.train_set.encoded,
            collate_fn=collate_encoded if self.train_set.encoded else None,
        )
        for n, (clips, labels) in enumerate(self.throughput.timed(loader)):
            step, micro = first_step + n // s.grad_accum, n % s.grad_accum
            if self.train_set.encoded:
                clips = decode_jpeg_batch(clips, self.device)
            clips, labels = clips.to(self.device, non_blocking=cuda), labels.to(self.device, non_blocking=cuda)
            # Seeded by data-parallel rank: the stages of one pipeline must crop their shared batch alike.
            g = torch.Generator().manual_seed(hash((s.seed, step, micro, self.dp_rank)) % (2**63))
            clips = random_crop_flip(clips, s.data.crop, s.data.flip, g)
            if s.data.mixup or s.data.cutmix:
                clips, labels = mix_batch(clips, labels, len(self.store.classes), s.data.mixup, s.data.cutmix, g)
            yield clips, labels

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Clip- and video-level accuracy of the current weights on the eval split (ranks share the clips)."""
        self.engine.eval()
        try:
            s = self.settings
            return evaluate_on_ranks(
                self.engine,
                self.eval_set,
                s.batch_per_rank,
                s.data.crop,
                self.dist.rank,
                self.dist.world_size,
                self.device,
            )
        finally:
            self.engine.train()

    # -- the loop ----------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        self._join()
        with self._run_dir_lock():
            return self._train()

    def _join(self) -> None:
        """Start the process group (before anything touches the run directory, so that every rank can agree)."""
        import deepspeed

        backend = "nccl" if self.device.type == "cuda" else "gloo"  # task_device set the current GPU first
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(minutes=10))

    @contextlib.contextmanager
    def _run_dir_lock(self):
        """One job writes a run directory: rank 0 takes its lock, and every rank stops with the same line if not."""
        lock = WriterLock(self.settings.run_dir, "run directory") if self.dist.is_main else None
        refusal = [None]
        if lock is not None:
            try:
                lock.acquire()
            except WriterBusy as exc:
                refusal = [str(exc)]
        torch.distributed.broadcast_object_list(refusal, src=0, device=collective_device())
        if refusal[0] is not None:
            raise WriterBusy(refusal[0])
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def _train(self) -> dict[str, Any]:
        s = self.settings
        self.run.prepare()
        self._fit_to_checkpoint()
        self._fetch_start_weights()
        self._build_engine()
        preemption = Preemption(self.max_requeues)
        self.step = self.checkpointer.resume(self._universal_tag)
        writer = self._tensorboard()
        self.throughput = self._throughput_meter()
        progress = Progress(s.steps - self.step, "training", unit="step", enabled=self.dist.is_main)
        batches = self._batches(self.step)
        self.throughput.start()
        logged = self.step
        while self.step < s.steps:
            torch.manual_seed(s.seed * 1_000_003 + self.step)  # dropout and drop-path repeat after a resume
            loss = self.layout.train_step(self, batches)
            self.step += 1
            self.throughput.step_done()
            self._log_train(loss, writer)
            if self.step % s.log_every == 0 or self.step == s.steps:
                progress.update(self.step - logged, **self._log_throughput(loss, writer))
                logged = self.step
            if self.step < s.steps and self.step % s.checkpoint_every == 0:
                self.checkpointer.save(self.step)
            if self.step < s.steps and self.step % s.eval_every == 0 and self.layout.evaluates_while_training:
                self._log_eval(self.evaluate(), writer)
            if preemption.requested():
                self.checkpointer.save(self.step)
                preemption.requeue()
        progress.close()
        self.checkpointer.save(self.step)
        return self._finish(writer)

    def _lr(self) -> float:
        return float(max(self.engine.get_lr()))  # the head's, with layer-wise decay

    def _peak_memory_gib(self) -> float:
        """The most GPU memory this rank's tensors held (on CPUs: the process's peak resident size)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    def _throughput_meter(self) -> Throughput:
        s = self.settings
        flops = self.arch.flops() if self.arch.flops else None
        # Only rank 0 logs; a device missing from the datasheet table is measured there, once.
        device_peak = peak(self.device) if flops and self.dist.is_main else None
        if device_peak is not None:
            log.info(
                "MFU against %.3g TFLOP/s per device (%s, %s)",
                device_peak.tflops,
                device_peak.device,
                device_peak.source,
            )
        clips_per_step = s.batch_per_rank * s.grad_accum * self.dp_size
        return Throughput(clips_per_step, flops, device_peak, self.dist.world_size)

    # -- outputs -----------------------------------------------------------------------
    def _tensorboard(self):
        if not self.dist.is_main:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run.tensorboard), purge_step=self.step or None)

    def _log_train(self, loss: float, writer) -> None:
        if not self.dist.is_main:
            return
        self.run.append_metrics(
            {"kind": "train", "step": self.step, "loss": loss, "lr": self._lr(), "time": time.time()}
        )
        if writer is not None:
            writer.add_scalar("train/loss", loss, self.step)
            writer.add_scalar("train/lr", self._lr(), self.step)

    def _log_throughput(self, loss: float, writer) -> dict[str, str]:
        """The figures of the progress line since the last one; also into metrics.jsonl and TensorBoard."""
        figures = self.throughput.figures()
        line = {"loss": f"{loss:.4f}", "lr": f"{self._lr():.2e}"}
        if not self.dist.is_main or not figures:
            return line
        line["clips/s"] = f"{figures['clips_per_s']:.1f}"
        if "tflops" in figures:
            line["TFLOP/s"] = f"{figures['tflops']:.3f}"
        if "mfu" in figures:
            line["MFU"] = f"{figures['mfu']:.1%}"
        line["data-wait"] = f"{figures['data_wait']:.0%}"
        self.run.append_metrics({"kind": "throughput", "step": self.step, **figures})
        if writer is not None:
            for key, value in figures.items():
                writer.add_scalar(f"throughput/{key}", value, self.step)
        return line

    def _log_eval(self, metrics: dict[str, Any], writer) -> None:
        if not self.dist.is_main:
            return
        self.run.append_metrics({"kind": "eval", "step": self.step, **metrics})
        log.info(
            "step %d: %s loss %.4f, clip top-1 %.3f, video top-1 %.3f (%d videos)",
            self.step,
            metrics["split"],
            metrics["loss"],
            metrics["clip_top1"],
            metrics["video_top1"],
            metrics["videos"],
        )
        if writer is not None:
            for key in EVAL_FIGURES:
                writer.add_scalar(f"{metrics['split']}/{key}", metrics[key], self.step)

    def _finish(self, writer) -> dict[str, Any]:
        """Consolidated fp32 weights, the final evaluation, plots and what the registry needs."""
        summary = {**self.throughput.summary(), "peak_memory_gib": self._peak_memory_gib()}
        state = self.layout.final_state(self, self.checkpoints.tag(self.step))
        metrics = self.layout.final_metrics(self, state)
        result: dict[str, Any] = {"step": self.step, "throughput": summary}
        if self.dist.is_main:
            self.run.append_metrics({"kind": "summary", "step": self.step, **summary})
            self._log_eval(metrics, writer)
            if writer is not None:
                writer.close()
            s = self.settings
            record = RunRecord.of_run(
                s.model.name, s.model.overrides(), self.store, s.data.crop, metrics, self.step, self.dist
            )
            weights = self.run.write_final(state, record, metrics)
            result.update(metrics=metrics, weights=str(weights))
            log.info(
                "finished at step %d: %s video top-1 %.3f; weights in %s",
                self.step,
                metrics["split"],
                metrics["video_top1"],
                weights,
            )
        torch.distributed.barrier()
        return result


def parameter_groups(model: torch.nn.Module, layers: int, lr: float, decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in optimizer groups: one per layer with layer-wise learning-rate decay.

    Parameters are named by their layer's index (``3.attn.qkv.weight``), in a plain model and in a
    pipeline stage alike; layer ``i`` of ``layers`` learns at ``lr x decay^(layers - 1 - i)``, as in
    BEiT and VideoMAE. DeepSpeed's warm-up and cosine schedule scale each group's own rate.
    """
    if decay == 1.0:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    by_layer: dict[int, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            by_layer.setdefault(int(name.split(".")[0]), []).append(param)
    return [{"params": params, "lr": lr * decay ** (layers - 1 - i)} for i, params in sorted(by_layer.items())]
