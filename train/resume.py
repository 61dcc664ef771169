"""Where a run starts, decided once: from its newest usable checkpoint, resharded or not, or from starting weights.

A requeued, killed or preempted job starts again with the same command, so the
plan is made anew at every start and answers every question about the start in
one place: which checkpoint (the newest complete one whose files verify; rank 0
hashes them once and tells the others), whether DeepSpeed must reshard it for
another number of ranks, the gradient accumulation that keeps the global batch,
and the starting weights, which only a run without a checkpoint needs (and
fetches from the registry, once).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clipforge.hpc.collective import over_torch, rank_zero_decides
from clipforge.hpc.distenv import DistEnv
from clipforge.rundir import CheckpointIndex

from .parallel import global_batch
from .settings import TrainError, TrainSettings

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    checkpoint: str | None
    """The checkpoint to load (verified), None for a fresh start."""
    step: int
    """The step the run continues from."""
    grad_accum: int
    """Micro-batches per step: the written global batch over this job's data-parallel ranks."""
    reshard: bool
    """The checkpoint was written by another number of ranks: load it in DeepSpeed's universal form."""
    weights: Path | None
    """The starting weights of a fresh start (a file every rank reads), None otherwise."""

    @property
    def universal_tag(self) -> str | None:
        return f"{self.checkpoint}-universal" if self.reshard else None


def plan_resume(
    settings: TrainSettings,
    checkpoints: CheckpointIndex,
    dist: DistEnv,
    dp_size: int,
    elastic: bool,
    fetch_weights: Callable[[], Path] | None,
) -> ResumePlan:
    """Rank 0 decides (verifying, fetching), every rank gets the same plan or the same one-line refusal."""
    decide = functools.partial(_decide, settings, checkpoints, dp_size, elastic, fetch_weights)
    return rank_zero_decides(decide, dist.is_main, over_torch, error=TrainError)


def _decide(
    s: TrainSettings,
    checkpoints: CheckpointIndex,
    now: int,
    elastic: bool,
    fetch_weights: Callable[[], Path] | None,
) -> ResumePlan:
    def skipped(tag: str, why: str) -> None:
        log.warning("checkpoint %s is unusable (%s); trying the one before", tag, why)

    tag = checkpoints.newest_usable(skipped)
    if tag is None:
        weights = fetch_weights() if fetch_weights is not None else s.model.weights
        return ResumePlan(None, 0, s.grad_accum, False, Path(weights) if weights is not None else None)
    step = checkpoints.step(tag)
    written = checkpoints.writers(tag)
    if not written or written["data_parallel"] == now:
        return ResumePlan(tag, step, s.grad_accum, False, None)
    was = written["data_parallel"]
    if not elastic:
        raise TrainError(
            f"checkpoint {tag} was written by {was} data-parallel ranks and this job has {now}: run it on "
            f"{was}, or start the run with --elastic-min-nodes to allow a restart on fewer nodes"
        )
    if s.parallel.layout != "plain" or s.parallel.zero_stage == 3:
        raise TrainError(
            f"checkpoint {tag} was written by {was} ranks and this job has {now}: an elastic restart "
            "reshards ZeRO 0-2 data parallel only (a pipeline needs its stages, ZeRO-3 its partitions)"
        )
    per_micro_batch = global_batch(s.batch_per_rank, 1, now)  # the global batch of one micro-batch a rank
    if written["global_batch"] % per_micro_batch:
        raise TrainError(
            f"the run's global batch of {written['global_batch']} clips does not divide over {now} ranks of "
            f"{s.batch_per_rank}; restart it on a number of ranks that divides it"
        )
    grad_accum = written["global_batch"] // per_micro_batch
    log.warning(
        "checkpoint %s was written by %d data-parallel ranks, this job has %d: gradient accumulation %d -> %d keeps "
        "the global batch of %d clips",
        tag,
        was,
        now,
        s.grad_accum,
        grad_accum,
        written["global_batch"],
    )
    # ZeRO's optimizer partitions are cut per rank: stage 0 loads as it is, 1-2 go through the universal form.
    return ResumePlan(tag, step, grad_accum, s.parallel.zero_stage > 0, None)


def make_universal(plan: ResumePlan, checkpoints: CheckpointIndex, dist: DistEnv, dp_size: int) -> None:
    """Convert the plan's checkpoint into DeepSpeed's universal form (rank 0; the others wait)."""
    tag = plan.universal_tag
    if tag is None:
        return
    target = checkpoints.path(tag)
    if dist.is_main and not target.exists():
        partial = target.with_name(tag + ".partial")
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"]
        command += ["--input_folder", str(checkpoints.path(plan.checkpoint)), "--output_folder"]
        command += [str(partial), "--num_extract_workers", "1", "--num_merge_workers", "1"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise TrainError(
                f"checkpoint {plan.checkpoint} could not be resharded for {dp_size} ranks: "
                f"{(result.stderr.strip().splitlines() or ['no message'])[-1]}"
            )
        partial.rename(target)
        log.info("checkpoint %s resharded (universal form in %s)", plan.checkpoint, target)
    torch.distributed.barrier()


def load_planned(engine: Any, plan: ResumePlan, checkpoints: CheckpointIndex, dist: DistEnv) -> None:
    """Load the plan's checkpoint into ``engine`` on every rank (the universal form when resharding)."""
    if plan.checkpoint is None:
        return
    engine.load_checkpoint(str(checkpoints.folder), tag=plan.universal_tag or plan.checkpoint)
    if plan.reshard:
        torch.distributed.barrier()
        if dist.is_main:
            checkpoints.discard(plan.universal_tag)
            (checkpoints.folder / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer
    if dist.is_main:
        resharded = ", resharded" if plan.reshard else ""
        log.info(
            "resumed from checkpoint %s at step %d%s (restart %d)",
            plan.checkpoint,
            plan.step,
            resharded,
            dist.restart_count,
        )
