"""One writer at a time for a directory (a clip store, a run directory), on Lustre and NFS.

POSIX and flock locks are unreliable or off on parallel filesystems, so the lock
is a file created atomically (``O_CREAT | O_EXCL``, which Lustre and NFSv3+
honour) holding who wrote it: Slurm job id and restart count, host, pid and
start time. While held, a thread touches it every HEARTBEAT_S seconds.

A second writer is refused in one line naming the holder, unless the holder is
provably gone: an earlier run of the same Slurm job (a requeue starts only
after the old run ended, with a higher ``SLURM_RESTART_COUNT``), a process on
this host that no longer exists, a Slurm job that the scheduler no longer
runs, or a heartbeat older than STALE_S. A lock left by a killed job therefore
never blocks its requeue.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clipforge.base.errors import UserError

from .collective import over_torch, rank_zero_decides
from .processes import process_alive

LOCK_NAME = ".clipforge-writer.json"
HEARTBEAT_S = 30.0
STALE_S = 5 * HEARTBEAT_S


class WriterBusy(UserError):
    """Another job is writing the directory; the message names it."""


def identity() -> dict[str, Any]:
    """Who is writing: this Slurm job (id and restart) or this process."""
    return {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
    }


class WriterLock:
    """``with WriterLock(directory, "clip store"):`` holds the directory's lock for the block."""

    def __init__(self, directory: Path, what: str) -> None:
        self.directory, self.what = Path(directory), what
        self.path = self.directory / LOCK_NAME
        self.me = identity()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> WriterLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                reason = gone(holder, self.me, self._age())
                if reason is None:
                    raise WriterBusy(self._refusal(holder)) from None
                # Move the stale lock aside under a name of our own: of two takers, one rename wins.
                aside = self.path.with_name(f"{LOCK_NAME}.stale-{self.me['host']}-{self.me['pid']}")
                try:
                    os.rename(self.path, aside)
                    aside.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self._beat = threading.Thread(target=self._heartbeat, name="writer-lock", daemon=True)
            self._beat.start()
            return self
        raise WriterBusy(f"{self.directory}: could not take its writer lock ({self.path}); another job keeps taking it")

    def check_free(self) -> None:
        """Refuse (the same line as :meth:`acquire`) if a live writer holds the lock; take nothing."""
        if self.path.exists():
            holder = self._holder()
            if gone(holder, self.me, self._age()) is None:
                raise WriterBusy(self._refusal(holder))

    def release(self) -> None:
        self._stop.set()
        if self._holder() == self.me:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def _holder(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # being written this instant, or unreadable: judged by its age

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return float("inf")

    def _refusal(self, holder: dict[str, Any]) -> str:
        job = f"Slurm job {holder['job_id']}" if holder.get("job_id") else f"process {holder.get('pid', '?')}"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        cancel = f"scancel {holder['job_id']}" if holder.get("job_id") else f"kill {holder.get('pid', '?')}"
        return (
            f"{self.directory}: this {self.what} is being written by {job} on {holder.get('host', '?')} "
            f"since {since}; wait for it to end or stop it ({cancel}), or choose another directory"
        )


def gone(holder: dict[str, Any], me: dict[str, Any], age: float) -> str | None:
    """Why the lock's holder is certainly no longer writing, or None when it may be."""
    if holder.get("job_id") and holder["job_id"] == me.get("job_id") and holder.get("restart", 0) < me["restart"]:
        return "an earlier run of this same Slurm job (requeued)"
    if holder.get("host") == me["host"] and holder.get("pid") and not process_alive(int(holder["pid"])):
        return "its process is gone"
    if holder.get("job_id") and _slurm_job_ended(holder["job_id"]):
        return "its Slurm job has ended"
    if age > STALE_S:
        return f"no heartbeat for {age:.0f} s"
    return None


def _slurm_job_ended(job_id: str) -> bool:
    """True only when the scheduler answers that the job is not pending or running."""
    try:
        result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    if result.returncode != 0:
        return "Invalid job id" in result.stderr  # long gone from the controller's memory
    return result.stdout.strip() not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")


@contextlib.contextmanager
def held_by_rank_zero(directory: Path, what: str, rank: int) -> Iterator[None]:
    """The directory's writer lock, taken by rank 0 for a job of many ranks; every rank stops with the same line if not.

    Call it with the process group started: rank 0's verdict is broadcast.
    """
    lock = WriterLock(directory, what) if rank == 0 else None

    def take() -> None:  # the answer broadcast is "taken" (None) or the refusal, never the lock itself
        lock.acquire()

    rank_zero_decides(take, rank == 0, over_torch)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
