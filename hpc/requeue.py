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
from collections.abc import Callable

import submitit
from submitit.helpers import Checkpointable

from .distenv import dist_env

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
            log.warning("state saved; not requeuing: the job has been requeued %d times (bound %d)", restarts, self.max_requeues)
            return None
        log.warning("state saved; requeuing (restart %d of at most %d)", restarts + 1, self.max_requeues)
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)
