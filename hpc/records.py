"""What ``clipforge jobs list|status|logs|cancel`` reads: submitit's job folders.

Each submission leaves a folder ``<jobs root>/<job id>/`` with submitit's
pickles and logs and a small ``clipforge-job.json``. States of Slurm jobs come
from one ``sacct`` call for all of them, cached for 30 s so that no loop of
ours polls the scheduler faster than that.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import time
from pathlib import Path

from clipforge.base.errors import UserError
from clipforge.base.files import write_json
from clipforge.base.logs import failure_reason

from .executor import RECORD, job_logs, jobs_root
from .processes import process_alive, process_tree

POLL_INTERVAL_S = 30.0
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "UNKNOWN", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")
"""States of a job that has not ended."""
_CACHE = ".sacct-cache.json"


class UnknownJob(UserError, LookupError):
    """A job id that no submission through clipforge left behind."""


@dataclasses.dataclass
class JobRecord:
    job_id: str
    name: str
    executor: str
    submitted_at: float
    folder: Path
    state: str = "UNKNOWN"

    @property
    def logs(self) -> list[Path]:
        return job_logs(self.folder)


def list_jobs(root: Path | None = None) -> list[JobRecord]:
    """Every job submitted through clipforge under ``root``, newest first, with its state."""
    root = Path(root or jobs_root())
    records = _with_states([_read(path) for path in root.glob(f"*/{RECORD}")], root)
    return sorted(records, key=lambda r: r.submitted_at, reverse=True)


def _read(path: Path) -> JobRecord:
    data = json.loads(path.read_text())
    return JobRecord(str(data["job_id"]), data["name"], data["executor"], data["submitted_at"], path.parent)


def _with_states(records: list[JobRecord], root: Path) -> list[JobRecord]:
    for record in records:
        record.state = _state_from_results(record) or record.state
    # Only jobs without a result ask the scheduler: sacct lags the end of a job by seconds.
    slurm_ids = [r.job_id for r in records if r.executor == "slurm" and r.state == "UNKNOWN"]
    states = slurm_states(slurm_ids, root) if slurm_ids else {}
    for record in records:
        if record.job_id in states:
            record.state = states[record.job_id]
        elif record.executor == "local" and record.state == "UNKNOWN":
            record.state = "RUNNING" if _pid_alive(record.job_id) else "FAILED"
    return records


def failure(record: JobRecord) -> str | None:
    """The one-line reason a job that ended without success gave in its logs (None for a running or done job)."""
    if record.state in ACTIVE or record.state == "COMPLETED":
        return None
    return failure_reason(record.logs)


def find_job(job_id: str, root: Path | None = None) -> JobRecord:
    """One job's record and state: its own folder (named by its id), read alone, not every job's."""
    base = Path(root or jobs_root())
    own = base / job_id / RECORD
    paths = [own] if own.is_file() else list(base.glob(f"*/{RECORD}"))
    for record in (_read(path) for path in paths):
        if record.job_id == job_id:
            return _with_states([record], base)[0]
    raise UnknownJob(f"no job {job_id} under {root or jobs_root()}; `clipforge jobs list` shows the known ones")


def slurm_states(job_ids: list[str], root: Path, now: float | None = None) -> dict[str, str]:
    """States from sacct, at most one query per POLL_INTERVAL_S (cached beside the job folders)."""
    now = time.time() if now is None else now
    cache = root / _CACHE
    try:
        cached = json.loads(cache.read_text())
        if now - cached["at"] < POLL_INTERVAL_S and set(job_ids) <= set(cached["states"]):
            return cached["states"]
    except (FileNotFoundError, ValueError, KeyError):
        pass
    result = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    states: dict[str, str] = {}
    if result.returncode == 0:
        for line in result.stdout.splitlines():
            jid, _, state = line.partition("|")
            states[jid] = state.split()[0] if state else "UNKNOWN"
    root.mkdir(parents=True, exist_ok=True)
    write_json(cache, {"at": now, "states": states})
    return states


def slurm_runs(job_id: str) -> list[dict[str, str]]:
    """Every run of a Slurm job, oldest first: a requeued job has one per start (``sacct --duplicates``).

    A run that a node failure ended reads ``NODE_FAIL``, one that was requeued ``REQUEUED``; the
    last run is the job's current state. Empty when the scheduler has no such job (or no sacct).
    """
    fields = ("state", "nodes", "start", "end", "exit_code")
    try:
        result = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-o", "JobID,State,NodeList,Start,End,ExitCode", "-j", job_id],
            capture_output=True,
            text=True,
            env=os.environ,
        )
    except FileNotFoundError:
        return []
    runs = []
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        jid, *values = line.split("|")
        if jid == job_id and len(values) == len(fields):
            run = dict(zip(fields, values))
            run["state"] = run["state"].split()[0]  # "CANCELLED by 0" -> CANCELLED
            runs.append(run)
    return runs


def cancel(record: JobRecord) -> None:
    if record.executor == "slurm":
        subprocess.run(["scancel", record.job_id], check=True)
    else:
        # submitit's tasks ignore SIGTERM (they wait for USR2), and the local controller shares our
        # process group: kill the controller's own process tree, tasks first.
        for pid in reversed(process_tree(int(record.job_id))):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


_STATE = "clipforge-state.json"
"""A job's outcome read from its result pickles, kept beside them with their sizes and times."""


def _state_from_results(record: JobRecord) -> str | None:
    """COMPLETED or FAILED from submitit's result pickles, when every task has written one.

    A result pickle holds the task's whole return value (a training's carries its confusion matrix, 2 MB at
    1000 classes): each job's is read once, then its outcome is kept until the pickles change.
    """
    results = sorted(record.folder.glob("*_result.pkl"))
    if not results:
        return None
    signature = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in results]
    kept = record.folder / _STATE
    try:
        cached = json.loads(kept.read_text())
        if cached["results"] == signature:
            return str(cached["state"])
    except (FileNotFoundError, ValueError, KeyError):
        pass
    outcomes = [pickle.loads(p.read_bytes())[0] for p in results]  # our own job's files
    state = "COMPLETED" if all(o == "success" for o in outcomes) else "FAILED"
    try:
        write_json(kept, {"state": state, "results": signature})
    except OSError:
        pass  # a folder we may read but not write (another user's): read the pickles again next time
    return state


def _pid_alive(job_id: str) -> bool:
    try:
        return process_alive(int(job_id))
    except ValueError:
        return False
