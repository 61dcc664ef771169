"""Training a video classifier with DeepSpeed, from the clip store, resumable to the step.

Every choice that makes a run repeatable is made per step, not per process:
which samples a step takes (a function of seed and step), the augmentation
(a generator seeded by seed and step), dropout and drop-path (the global RNG
reseeded by seed and step). So a run resumed from a checkpoint after a
requeue computes the same losses as one that never stopped.

The loop never waits for the device by accident: a step's loss stays there
until the end of its log window, when the window's losses, the preemption
flag and the checkpoint writer's health cross to the host in one collective.
A window ends every --log-every steps, or sooner where those take longer
than --preemption-poll-s, so a preemption notice is acted on in time.
Checkpoints block only for a snapshot in host memory.

This module is the loop. What the run is asked to do is in :mod:`.settings`,
where it starts in :mod:`.resume`, the engine in :mod:`.engine`, how the
engine holds the model in :mod:`.layout`, its input in :mod:`.batches`,
checkpoints in :mod:`.checkpointing`, what it records in :mod:`.runlog`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from clipforge.hpc.collective import over_torch, rank_zero_decides
from clipforge.hpc.distenv import (
    DistEnv,
    collective_device,
    init_process_group,
    setup_distributed,
    task_device,
    wait_for_ranks,
)
from clipforge.hpc.lock import held_by_rank_zero
from clipforge.hpc.requeue import Preemption
from clipforge.inference.evaluation import evaluate_model
from clipforge.models.builders import Architecture
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.rundir import RunDir, RunRecord

from .batches import Batch, train_batches
from .checkpointing import Checkpointer
from .engine import build_engine, class_weights, has_batchnorm
from .layout import LAYOUTS, EngineLayout, ModelPlan
from .objectives import objective_of
from .parallel import global_batch
from .resume import ResumePlan, load_planned, make_universal, plan_resume
from .runlog import RunLog
from .sampler import StepSampler
from .settings import TrainError, TrainSettings, resolve_settings, steps_of_epochs
from .throughput import Throughput, peak_memory_gib

log = logging.getLogger(__name__)


class Trainer:
    """One training run: checked in ``__init__``; :meth:`train` runs it (or start, run and finish, one by one)."""

    # configuration
    settings: TrainSettings
    dist: DistEnv
    max_requeues: int
    elastic: bool
    """Whether a resume may find another number of data-parallel ranks than the checkpoint's writers."""
    fetch_weights: Callable[[Path], Path] | None
    """Rank 0 copies the starting weights into the folder it is given and returns their file (registry weights)."""
    # data and model
    run_dir: RunDir
    store: ClipStore
    train_set: ClipDataset
    eval_set: ClipDataset
    arch: Architecture
    # built by start()
    plan: ResumePlan
    layout: EngineLayout
    engine: Any
    checkpointer: Checkpointer
    throughput: Throughput
    records: RunLog
    preemption: Preemption
    # training state
    step: int

    def __init__(
        self,
        settings: TrainSettings,
        max_requeues: int = 3,
        elastic: bool = False,
        fetch_weights: Callable[[Path], Path] | None = None,
        start_architecture: Callable[[], tuple[str, dict]] | None = None,
    ) -> None:
        self.settings, self.max_requeues, self.elastic, self.fetch_weights = (
            settings,
            max_requeues,
            elastic,
            fetch_weights,
        )
        self.dist = setup_distributed()
        if settings.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: its own workspace rule
            torch.use_deterministic_algorithms(True)
        if start_architecture is not None:  # weights from elsewhere (a registry version) bring their architecture
            init_process_group(self.dist, self.device, single=True)  # rank 0 reads it, every rank builds it
            model, overrides = rank_zero_decides(start_architecture, self.dist.is_main, over_torch, TrainError)
            settings.model.adopt(model, overrides, str(settings.model.weights))
        asked = settings.steps
        self.store, self.arch = resolve_settings(settings, self.dist.world_size)
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
        self.run_dir = RunDir(settings.run_dir)
        self.objective = objective_of(settings)
        self.class_weights: torch.Tensor | None = None
        self.step = 0

    @property
    def dp_size(self) -> int:
        return self.settings.parallel.data_parallel(self.dist.world_size)

    @functools.cached_property
    def device(self) -> torch.device:
        return task_device(self.dist)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The objective's loss of one micro-batch (:mod:`.objectives`)."""
        return self.objective.loss(output, labels, self.class_weights, self.settings)

    # -- the run ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        with self.session():
            self.start()
            self.run()
            return self.finish()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The process group and the run directory's lock, held while the run trains; writers stopped on errors."""
        import deepspeed

        init_process_group(self.dist, self.device, single=True)  # task_device set the current GPU first
        # DeepSpeed's comm layer adopts that group; a PipelineModule needs it before deepspeed.initialize.
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        with held_by_rank_zero(self.settings.run_dir, "run directory", self.dist.rank):
            try:
                yield
            finally:
                if hasattr(self, "checkpointer"):
                    self.checkpointer.close()

    def start(self) -> None:
        """Decide where the run starts, build the engine there, and ready the meters (inside :meth:`session`)."""
        s, main = self.settings, self.dist.is_main
        self.run_dir.prepare()
        fetch = functools.partial(self.fetch_weights, self.run_dir.start_weights) if self.fetch_weights else None
        self.plan = plan_resume(s, self.run_dir.checkpoints, self.dist, self.dp_size, self.elastic, fetch)
        clips_per_step = global_batch(s.batch_per_rank, self.plan.grad_accum, self.dp_size)
        if self.plan.grad_accum != s.grad_accum:  # an elastic restart keeps the run's global batch, and so its steps
            steps_of_epochs(s, len(self.train_set), clips_per_step)
            if s.epochs is not None and main:
                log.info("%g epochs in the run's global batches: %d steps", s.epochs, s.steps)
        make_universal(self.plan, self.run_dir.checkpoints, self.dist, self.dp_size)
        if s.data.class_balance == "loss":
            self.class_weights = class_weights(self.train_set.labels, len(self.store.classes))
        torch.manual_seed(s.seed)
        model_plan = ModelPlan(self.arch, s.parallel, s.precision, s.seed, self.loss, self.plan.weights, main)
        self.layout = LAYOUTS[s.parallel.layout](model_plan)
        if not self.layout.evaluates_while_training and s.eval_every < s.steps and main:
            log.warning("a pipeline evaluates once, at the end, on rank 0: --eval-every %d has no effect", s.eval_every)
        module = self.layout.module()
        self.engine = build_engine(s, self.arch, module, self.plan, self.dist, self.device, has_batchnorm(self.arch))
        written = {"world_size": self.dist.world_size, "data_parallel": self.dp_size}
        written["global_batch"] = clips_per_step
        self.checkpointer = Checkpointer(self.engine, self.run_dir.checkpoints, self.dist, s.keep_checkpoints, written)
        load_planned(self.engine, self.plan, self.run_dir.checkpoints, self.dist)
        self.step = self.plan.step
        self.preemption = Preemption(self.max_requeues)
        # Steps per log window at most, so that the ranks check for a preemption notice every --preemption-poll-s
        # (set at each window's end). The first window is the first step alone, which times the steps: a notice
        # that came during a first window of --log-every slow steps would wait for all of them.
        self._poll_steps = 1
        flops = self.arch.flops() if self.arch.flops else None
        self.throughput = Throughput.of_run(clips_per_step, flops, self.device, self.dist.world_size, main, s.precision)
        lr = lambda: float(max(self.engine.get_lr()))  # noqa: E731 - the head's, with layer-wise decay
        self.records = RunLog(self.run_dir, main, self.step, s.steps, self.throughput, lr, self.objective)
        self._batches = self._input()
        self.throughput.start()

    def _input(self) -> Iterator[Batch]:
        s = self.settings
        dp_rank = self.layout.data_parallel_rank(self.engine, self.dist.rank)
        local = s.data.shuffle == "shards"
        sampler = StepSampler(
            self.train_set.labels,
            s.batch_per_rank,
            self.plan.grad_accum,
            dp_rank,
            self.dp_size,
            s.seed,
            s.data.class_balance == "sampler",
            shards=self.train_set.shards if local else None,
            positions=self.train_set.positions if local else None,
            window=s.data.shuffle_window if local else 0,
        )
        classes = len(self.store.classes)
        return train_batches(
            self.train_set,
            sampler,
            s.data,
            classes,
            s.seed,
            self.plan.grad_accum,
            self.step,
            s.steps,
            dp_rank,
            self.device,
            self.throughput,
        )

    def run(self, until: int | None = None) -> None:
        """Train up to step ``until`` (default: the run's last): the loop."""
        s = self.settings
        until = s.steps if until is None else min(until, s.steps)
        losses: list[torch.Tensor] = []
        counted = self.step
        self._window_started = time.perf_counter()
        while self.step < until:
            torch.manual_seed(s.seed * 1_000_003 + self.step)  # dropout and drop-path repeat after a resume
            losses.append(self.layout.train_step(self.engine, self._batches, self.plan.grad_accum))
            self.step += 1
            self.records.step(self.step)
            if self.step == self.plan.step + 1:  # the first step (warm-up, compilation) stays out of the steady rate
                self._synchronize()
                self.throughput.steps_done(1)
                counted = self.step
            if self.step < s.steps and self.step % s.checkpoint_every == 0:
                self.checkpointer.save(self.step)
            if self.step < s.steps and self.step % s.eval_every == 0 and self.layout.evaluates_while_training:
                self.records.evaluation(self.step, self.evaluate())
            if self.step % s.log_every == 0 or self.step == until or len(losses) >= self._poll_steps:
                preempted = self._window_end(losses, self.step - counted)
                losses, counted = [], self.step
                if preempted:
                    self.checkpointer.save(self.step, wait=True)
                    self.preemption.requeue()

    def _window_end(self, losses: list[torch.Tensor], uncounted: int) -> bool:
        """The window's losses, the preemption flag and the writer's health, in one collective; True: preempted."""
        local = torch.stack(losses)
        self._synchronize()
        step_s = (time.perf_counter() - self._window_started) / len(losses)
        flags = torch.tensor([float(self.preemption.flag), float(self.checkpointer.write_failed()), step_s])
        if self.dist.world_size > 1:
            vector = torch.cat([local.to(collective_device()), flags.to(collective_device())])
            torch.distributed.all_reduce(vector)
            mean = local if self.layout.losses_are_global else vector[: len(losses)] / self.dp_size
            host, (preempted, failed, step_s) = mean.tolist(), vector[len(losses) :].tolist()
            step_s /= self.dist.world_size
        else:
            host, (preempted, failed, step_s) = local.tolist(), flags.tolist()
        # Every rank has the same sum, so every rank ends its next window at the same step. Steps of 0.1 s under the
        # default 10 s check every 100 steps, so --log-every decides; steps of 5 s check every 2 steps.
        self._poll_steps = max(1, math.ceil(self.settings.preemption_poll_s / step_s)) if step_s > 0 else 1
        self._window_started = time.perf_counter()
        self.throughput.steps_done(uncounted)
        self.records.window(host)
        self.records.checkpoint(self.checkpointer.finished())
        if failed:
            self.checkpointer.fail()
        return bool(preempted)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate(self) -> dict[str, Any]:
        """The objective's evaluation of the current weights on the eval split (ranks share the clips)."""
        self.engine.eval()
        try:
            d = self.dist
            return self.objective.evaluate(self.engine, self.eval_set, self.settings, d.rank, d.world_size, self.device)
        finally:
            self.engine.train()

    def _evaluate_alone(self, model: torch.nn.Module) -> dict[str, Any]:
        """A pipeline's final evaluation on rank 0: on its device, or on the CPU when the whole model does not fit
        beside its stage there (a pipeline is for models too large for one device)."""
        s = self.settings
        try:
            return evaluate_model(model, self.eval_set, s.batch_per_rank, s.data.crop, self.device, s.data.workers)
        except torch.cuda.OutOfMemoryError:
            model.cpu()
            torch.cuda.empty_cache()
            log.warning("the whole model does not fit on %s beside its stage: evaluating on the CPU", self.device)
            return evaluate_model(model, self.eval_set, s.batch_per_rank, s.data.crop, "cpu", s.data.workers)
        finally:
            model.cpu()

    def finish(self) -> dict[str, Any]:
        """The last checkpoint, consolidated fp32 weights, the final evaluation, plots and the run's record."""
        main = self.dist.is_main
        self.checkpointer.save(self.step, wait=True)
        self.records.checkpoint(self.checkpointer.finished())
        self.records.progress.close()
        summary = {**self.throughput.summary(), "peak_memory_gib": peak_memory_gib(self.device)}
        s = self.settings
        if self.layout.evaluates_while_training:
            metrics = self.evaluate()  # a collective: before rank 0 alone consolidates the weights
        tag = self.run_dir.checkpoints.tag(self.step)
        state = self.layout.final_state(self.engine, self.run_dir.checkpoints, tag, main)
        state = self.objective.final_state(state)
        if not self.layout.evaluates_while_training and main:
            model = self.arch.build(seed=s.seed)
            model.load_state_dict(state)
            metrics = self._evaluate_alone(model)
        result: dict[str, Any] = {"step": self.step, "throughput": summary}
        if main:
            self.records.summary(self.step, summary)
            self.records.evaluation(self.step, metrics)
            self.records.close()
            record = RunRecord.of_run(
                s.model.name, s.model.overrides(), self.store, s.data.crop, metrics, self.step, self.dist
            )
            self.objective.annotate(record, s)
            weights = self.run_dir.write_final(state, record, metrics)
            result.update(metrics=metrics, weights=str(weights))
            figure, value = self.objective.headline_words, metrics[self.objective.headline]
            log.info(
                "finished at step %d: %s %s %.4f; weights in %s", self.step, metrics["split"], figure, value, weights
            )
        # Not a collective barrier: rank 0's consolidation and (for a pipeline) evaluation may pass its timeout.
        wait_for_ranks("finished")
        return result
