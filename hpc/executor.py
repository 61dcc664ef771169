"""Submitting work: one function for Slurm, local processes and in-process debugging.

The job code never knows which executor runs it: it reads its rank from
:func:`clipforge.hpc.distenv.setup_distributed` and its restart count from the
same place, whatever the executor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import submitit
from submitit.helpers import clean_env

from clipforge.base.files import write_json

from .profile import ClusterProfile
from .resources import ResourceError, Resources

log = logging.getLogger(__name__)

ExecutorKind = Literal["slurm", "local", "debug"]
RECORD = "clipforge-job.json"


def jobs_root() -> Path:
    """Where submitit's job folders live; on a cluster this must be a shared filesystem."""
    home = Path(os.environ.get("CLIPFORGE_HOME", Path.home() / ".clipforge"))
    return Path(os.environ.get("CLIPFORGE_JOBS_DIR", home / "jobs"))


def job_logs(folder: Path) -> list[Path]:
    """The log files submitit writes into a job's folder: every task's stdout, then every task's stderr."""
    return sorted(Path(folder).glob("*_log.out")) + sorted(Path(folder).glob("*_log.err"))


def make_executor(
    resources: Resources,
    profile: ClusterProfile,
    kind: ExecutorKind | None = None,
    folder: Path | None = None,
) -> submitit.Executor:
    """An executor of the given kind (default: the profile's) asking for ``resources``."""
    kind = kind or profile.executor
    resources = profile.apply(resources)
    folder = Path(folder or jobs_root()) / "%j"
    if kind == "slurm":
        executor = submitit.SlurmExecutor(
            folder=folder, max_num_timeout=profile.max_requeues, python=shlex.quote(profile.python)
        )
        setup = profile.setup_lines()
        executor.update_parameters(**resources.submitit_parameters(), **({"setup": setup} if setup else {}))
        # Kept for the job record; submitit does not expose its own copy.
        executor.clipforge_kind = kind  # type: ignore[attr-defined]
        return executor
    if resources.nodes != 1:
        raise ResourceError(
            f"nodes: the {kind} executor runs on this machine only; ask for 1 node, not {resources.nodes}"
        )
    if kind == "local":
        executor = submitit.LocalExecutor(
            folder=folder, max_num_timeout=profile.max_requeues, python=shlex.quote(profile.python)
        )
        executor.update_parameters(
            timeout_min=resources.time_minutes,
            tasks_per_node=resources.ntasks_per_node,
            gpus_per_node=resources.gpus_per_node,
            signal_delay_s=resources.signal_delay_s,
        )
    elif kind == "debug":
        if resources.ntasks_per_node != 1:
            raise ResourceError(
                "ntasks_per_node: the debug executor runs one task in this process; use 1 or the local executor"
            )
        executor = submitit.DebugExecutor(folder=folder)
    else:
        raise ResourceError(f"executor: {kind!r} is not one of slurm, local, debug")
    executor.clipforge_kind = kind  # type: ignore[attr-defined]
    return executor


def submit(executor: submitit.Executor, fn: Callable[..., Any], *args: Any, name: str = "") -> submitit.Job:
    """Submit one job, with the caller's Slurm variables hidden.

    A job submitted from inside a job or an allocation inherits its SLURM_*
    variables (submitit #1782); an inherited SLURM_CPU_BIND made a fleet 3x slower.
    """
    started = time.time()
    with _clean_slurm_env():
        job = executor.submit(fn, *args)
    _set_aside_earlier(job, started)
    _record(job, executor, name or getattr(fn, "__name__", type(fn).__name__))
    return job


def submit_array(
    executor: submitit.Executor,
    fn: Callable[..., Any],
    arguments: Sequence[Any],
    name: str = "",
    parallelism: int = 256,
) -> list[submitit.Job]:
    """Submit one job array (a single ``sbatch --array``), one task per argument."""
    if getattr(executor, "clipforge_kind", "") == "slurm":
        executor.update_parameters(array_parallelism=parallelism)
    started = time.time()
    with _clean_slurm_env():
        jobs = executor.map_array(fn, arguments)
    for job in jobs:
        _set_aside_earlier(job, started)
        _record(job, executor, name or getattr(fn, "__name__", type(fn).__name__))
    return jobs


EARLIER_MARGIN_S = 60.0
"""How much older than its submission a file in a new job's folder must be to count as an earlier job's."""


def _set_aside_earlier(job: submitit.Job, submitted_at: float) -> None:
    """Move an earlier job's files out of the way of a new job with the same id.

    Job ids start over: a development cluster started afresh numbers from 1 again, and a local job's id is a
    process id, which the kernel reuses. submitit would read the earlier job's result as this one's (a job
    "done" at once, with another job's result) and append to its logs. Files written before the submission
    (with a margin for clocks) go to ``earlier-<time>/`` in the same folder, kept for whoever wants them.
    """
    folder = Path(str(job.paths.folder))
    if not folder.is_dir():
        return
    stale = [
        path
        for path in folder.glob(f"{job.job_id}_*")
        if path.is_file() and path.stat().st_mtime < submitted_at - EARLIER_MARGIN_S
    ]
    if not stale:
        return
    aside = folder / time.strftime("earlier-%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in stale)))
    aside.mkdir(exist_ok=True)
    for path in stale:
        path.rename(aside / path.name)
    log.warning(
        "job %s: its folder held %d files of an earlier job %s; moved to %s", job.job_id, len(stale), job.job_id, aside
    )


@contextlib.contextmanager
def _clean_slurm_env() -> Iterator[None]:
    """submitit's clean_env, keeping SLURM_CONF: it names the cluster, not the job we are in."""
    conf = os.environ.get("SLURM_CONF")
    with clean_env():
        if conf is not None:
            os.environ["SLURM_CONF"] = conf
        yield


def _record(job: submitit.Job, executor: submitit.Executor, name: str) -> None:
    """Write the small record that ``clipforge jobs`` lists."""
    folder = Path(str(job.paths.folder))
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "job_id": job.job_id,
        "name": name,
        "executor": getattr(executor, "clipforge_kind", "unknown"),
        "submitted_at": time.time(),
        "argv": sys.argv,
        "cwd": os.getcwd(),
    }
    write_json(folder / RECORD, record)
