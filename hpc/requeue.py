"""Surviving timeouts, preemption and ``scontrol requeue``.

Slurm sends USR2 ``signal_delay_s`` before the time limit (and on preemption
where the cluster is set up for it); submitit catches it on rank 0, calls the
job's ``checkpoint()`` and requeues the job with ``scontrol requeue``. A job
requeued by an operator gets no USR2 at all, only SIGTERM, and restarts from
the original submission. So a job that must lose nothing keeps its state on
disk as it goes and reads it back at start; ``checkpoint()`` is the last
chance to save, not the only one.

Note for short limits: submitit calls a signal a timeout (not a preemption)
once the job has run min(0.8 T, T - 10 min), so with limits of 10 minutes or
less every signal counts against the timeout budget.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable

import submitit
from submitit.helpers import Checkpointable
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

from .distenv import collective_device, dist_env

log = logging.getLogger(__name__)

_savers: list[Callable[[], None]] = []


def on_requeue(save: Callable[[], None]) -> None:
    """Register a function that saves the job's state before it is requeued."""
    _savers.append(save)


class RequeueableJob(Checkpointable):
    """A job that saves its state when signalled and asks to be requeued, a bounded number of times.

    Subclasses implement :meth:`run`; state savers are registered with :func:`on_requeue`.
    """

    def __init__(self, max_requeues: int = 3) -> None:
        self.max_requeues = max_requeues

    def __call__(self, *args, **kwargs):
        _savers.clear()
        return self.run(*args, **kwargs)

    def run(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission | None:
        restarts = dist_env().restart_count
        for save in _savers:
            save()
        if restarts >= self.max_requeues:
            log.warning(
                "state saved; not requeuing: the job has been requeued %d times (bound %d)", restarts, self.max_requeues
            )
            return None
        log.warning("state saved; requeuing (restart %d of at most %d)", restarts + 1, self.max_requeues)
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


class Preemption:
    """USR2 (time limit near, or preemption) noticed on any rank, acted on by all at a step boundary.

    A collective job (DeepSpeed, gloo) must save its checkpoint on every rank
    together, which submitit's rank-0 handler cannot do; so jobs that train
    install this handler instead, poll :meth:`requested` once per step, save,
    then call :meth:`requeue`.
    """

    def __init__(self, max_requeues: int = 3) -> None:
        self.max_requeues = max_requeues
        self.flag = False
        signal.signal(signal.SIGUSR2, self._handle)
        # submitit ignores SIGTERM (it waits for USR2), but `scontrol requeue` and scancel send only SIGTERM:
        # a job that ran on would finish a run that Slurm has already requeued, and report it twice.
        signal.signal(signal.SIGTERM, self._terminate)

    def _handle(self, signum, frame) -> None:
        log.warning("received %s: will checkpoint at the end of this step", signal.Signals(signum).name)
        self.flag = True

    def _terminate(self, signum, frame) -> None:
        log.warning(
            "received SIGTERM (requeued or cancelled): stopping now; the run resumes from its last complete checkpoint"
        )
        logging.shutdown()
        os._exit(143)

    def requested(self) -> bool:
        """Whether any rank was signalled (an all-reduce, so every rank gives the same answer)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.flag
        flag = torch.tensor([1 if self.flag else 0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def requeue(self) -> None:
        """Ask the scheduler to run the job again (rank 0), then end this process; bounded by max_requeues."""
        env = dist_env()
        if env.job_id is None or env.restart_count >= self.max_requeues:
            log.warning("checkpoint saved; not requeuing (restart %d, bound %d)", env.restart_count, self.max_requeues)
            raise SystemExit(1)
        if env.source == "submitit-local":
            raise SystemExit(LOCAL_REQUEUE_RETURN_CODE)  # submitit's local controller restarts the tasks
        if env.rank == 0:
            log.warning(
                "checkpoint saved; requeuing job %s (restart %d of at most %d)",
                env.job_id,
                env.restart_count + 1,
                self.max_requeues,
            )
            subprocess.run(["scontrol", "requeue", env.job_id], check=False)
        raise SystemExit(0)
