"""Saving and resuming a DeepSpeed engine in a run directory's checkpoint index, every rank together."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from clipforge.hpc.distenv import DistEnv
from clipforge.hpc.errors import UserError
from clipforge.rundir import CheckpointIndex

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint could not be written; the message names the last complete one, which stays valid."""


class Checkpointer:
    """Checkpoints of one engine: saved by every rank, marked complete by rank 0, resumed only when they verify."""

    def __init__(self, engine: Any, index: CheckpointIndex, dist: DistEnv, keep: int, layout: dict) -> None:
        self.engine, self.index, self.dist, self.keep, self.layout = engine, index, dist, keep, layout

    def save(self, step: int) -> None:
        """Save on every rank, then mark the checkpoint complete; only complete ones are ever resumed."""
        tag = self.index.tag(step)
        if self.index.is_complete(tag):
            return
        started = time.perf_counter()
        try:
            self.engine.save_checkpoint(str(self.index.folder), tag=tag, client_state={"step": step}, save_latest=False)
        except (OSError, RuntimeError) as exc:
            kept = next(iter(self.index.complete()), None)
            self.index.discard(tag)
            intact = (
                f"the last complete checkpoint {kept} is intact: free space and start the job again to resume from it"
                if kept
                else "there is no earlier checkpoint"
            )
            raise CheckpointError(
                f"checkpoint {tag} could not be written to {self.index.folder}: {exc}; {intact}"
            ) from None
        torch.distributed.barrier()
        if self.dist.is_main:
            self.index.mark_complete(tag, step, self.layout)
            self.index.prune(self.keep)
            log.info("checkpoint %s saved in %.2f s", tag, time.perf_counter() - started)
        torch.distributed.barrier()

    def resume(self, universal: str | None = None) -> int:
        """Load the newest checkpoint that verifies; returns its step (0 when there is none).

        ``universal``: the tag of that checkpoint converted to DeepSpeed's universal form, loaded
        instead (on another number of ranks), then removed once every rank has it.
        """
        if universal is not None:
            original = universal.removesuffix("-universal")
            self.engine.load_checkpoint(str(self.index.folder), tag=universal)
            step = self.index.step(original)
            torch.distributed.barrier()
            if self.dist.is_main:
                self.index.discard(universal)
                (self.index.folder / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer
                log.info(
                    "resumed from checkpoint %s at step %d, resharded (restart %d)",
                    original,
                    step,
                    self.dist.restart_count,
                )
            return step

        def skipped(tag: str, why: str) -> None:
            if self.dist.is_main:
                log.warning("checkpoint %s is unusable (%s); trying the one before", tag, why)

        tag = self.index.newest_usable(skipped)
        if tag is None:
            return 0
        _, client = self.engine.load_checkpoint(str(self.index.folder), tag=tag)
        step = int(client["step"])
        if self.dist.is_main:
            log.info("resumed from checkpoint %s at step %d (restart %d)", tag, step, self.dist.restart_count)
        return step
