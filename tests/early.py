"""The early work: what the tests check only once it has finished, started with the session and run beside the
suite at a lower CPU priority (:class:`Early`), and the pieces of it that are not federations (those are in
federations.py and few_labels.py): the device check, the trainings, the parameter-server runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clipforge.hpc.distenv import local_world
from clipforge.hpc.processes import process_tree

from .helpers import PS_EARLY, kill_tree, ps_argv, train_argv

EARLY_NICE = 5
"""The early work's CPU priority: below the suite's tests, yet enough for Flower's processes to report in time.

Flower gives a ServerApp or ClientApp process it has just started 30 s to report in, then 60 s between
heartbeats, or it fails the task. Starting one takes 1.5-2 CPU-seconds (importing Flower). At nice 19 beside
two busy cores a group gets about 1.5% of a core, so a start takes minutes: measured, a SecAgg+ federation at
nice 19 beside two busy loops never got its SuperNodes up; at nice 5 it finished its round in 242 s.
"""


def low_priority(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in a session of its own at :data:`EARLY_NICE`, its output in ``log``.

    The kernel's autogroup scheduling makes a new session a group of its own, and nice ranks a process only within
    its group: the group's own nice (set once the child is in its session) ranks it beside the others.
    """
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["nice", "-n", str(EARLY_NICE), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    with contextlib.suppress(OSError):
        Path(f"/proc/{process.pid}/autogroup").write_text(str(EARLY_NICE))
    return process


class Early:
    """Work that tests check later, started with the session and run beside the suite at a lower CPU priority.

    Much of the suite waits on Slurm with the cores idle; work that needs no cluster uses that idle time instead
    of its own minutes. At most ``at_once`` pieces run together, so their memory stays small beside the suite's.
    conftest starts what the collected tests need and puts the tests that wait on it last.

    Work that loads DeepSpeed's compiled op does so from a copy of the extensions folder (:meth:`own_extensions`):
    loading takes a file lock there, and a starved low-priority holder of the suite's lock once stalled the suite's
    own DeepSpeed runs (28 minutes instead of 19, at nice 19).
    """

    def __init__(self, root: Path, at_once: int = 2) -> None:
        self.root, self.running, self.done = root, [], {}
        self.env = dict(os.environ, CLIPFORGE_JOBS_DIR=str(root / "jobs"))
        self.pool = ThreadPoolExecutor(at_once)
        self.stopped, self.copying = threading.Event(), threading.Lock()
        threading.Thread(target=self._keep_low, daemon=True).start()

    def _keep_low(self) -> None:
        """Give every session the work starts the priority :data:`EARLY_NICE` as well, as soon as it appears.

        Flower's SuperLink starts its SuperExec, and so each ServerApp, in a session of its own: a new autogroup
        at the default priority, which would take a core from the suite's own tests.
        """
        lowered: set[int] = set()
        while not self.stopped.wait(0.5):
            for process in list(self.running):
                for pid in process_tree(process.pid) if process.poll() is None else []:
                    with contextlib.suppress(OSError):
                        session = os.getsid(pid)
                        if session not in lowered:
                            Path(f"/proc/{pid}/autogroup").write_text(str(EARLY_NICE))
                            lowered.add(session)

    def start(self, name: str, work, *args) -> None:
        """Queue ``work(self, *args)``; :meth:`result` gives what it returns."""
        self.done[name] = self.pool.submit(work, self, *args)

    def process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """``argv`` started at low priority, its output in ``ROOT/NAME.log``; killed at the end of the session."""
        self.running.append(low_priority(argv, self.root / f"{name}.log", env or self.env))
        return self.running[-1]

    def own_extensions(self) -> dict[str, str]:
        """The early environment with a copy of the suite's extensions folder, for work that loads DeepSpeed's
        compiled op: copied as it is now (built, or to be built there on first use), so no lock is shared."""
        suite, copy = Path(os.environ["TORCH_EXTENSIONS_DIR"]), self.root / "torch_extensions"
        with self.copying:  # once: a second copy would rewrite a library that an early process may be loading
            if suite.exists() and not copy.exists():
                shutil.copytree(suite, copy, ignore=shutil.ignore_patterns("lock"))
        return dict(self.env, TORCH_EXTENSIONS_DIR=str(copy))

    def result(self, name: str, timeout_s: float = 1800):
        return self.done[name].result(timeout=timeout_s)

    def stop(self) -> None:
        self.stopped.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in self.running:
            if process.poll() is None:
                kill_tree(process.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


DEVICE_CHECK_SMALL = ["--model", "videovit-tiny", "--depth", "2", "--tubelet", "2", "8", "8", "--frames", "8"]
DEVICE_CHECK_SMALL += ["--size", "32", "--crop", "24", "--steps", "6", "--batch-per-rank", "2", "--workers", "0"]
# One stage: the ZeRO stages themselves are tested in test_train.py; stage 2 runs in the kill-and-resume check.
DEVICE_CHECK_SMALL += ["--stages", "0"]
"""The device check's flags for a run on CPUs at a small size."""


def device_check(early: Early) -> tuple[int, str, Path]:
    """The device check (``jobs/gpu_check.py``, the script a GPU node runs) on CPUs at a small size: its exit
    status, its output and the table it wrote."""
    script, table = Path(__file__).resolve().parents[1] / "jobs" / "gpu_check.py", early.root / "device-check.md"
    argv = [sys.executable, str(script), *DEVICE_CHECK_SMALL, "--work", str(early.root / "device-check")]
    process = early.process("device-check", [*argv, "--out", str(table)], early.own_extensions())
    return process.wait(timeout=1800), (early.root / "device-check.log").read_text(errors="replace"), table


def training(early: Early, mpiexec: list[str], store: Path, name: str, spec: tuple[tuple[str, ...], int, int]) -> Path:
    """The run ``name`` of :data:`EARLY_TRAININGS` or :data:`LATE_TRAININGS` (``spec``: its flags, ranks and
    steps); its run directory once it ended well."""
    extra, ranks, steps = spec
    run = early.root / "trainings" / name
    run.parent.mkdir(exist_ok=True)
    argv = train_argv(mpiexec, store, run, *extra, ranks=ranks, steps=steps)
    # mpiexec's session folder is TMPDIR/ompi.PID: a fresh TMPDIR each. PIDs wrap around (at 32768 here) within
    # a suite, and a killed mpiexec's stale folder under a reused PID is the likely reason PMIx's listener once
    # failed to start.
    env = dict(early.own_extensions(), TMPDIR=tempfile.mkdtemp(prefix="cf-mpi-"))
    process = early.process(f"train-{name}", argv, env)
    assert process.wait(timeout=1800) == 0, (early.root / f"train-{name}.log").read_text()[-4000:]
    return run


class Runs:
    """The early trainings by name, each waited for when a test first asks for it (:func:`training`)."""

    def __init__(self, early: Early, prefix: str = "train-") -> None:
        self.early, self.prefix = early, prefix

    def __getitem__(self, name: str | int) -> Path:
        return self.early.result(f"{self.prefix}{name}")


def ps_runs(early: Early, store: Path) -> dict[str, Path]:
    """Every run of :data:`PS_EARLY`, one after another, a process per rank as Slurm or torchrun would start them;
    their run directories once all ended well."""
    runs = {}
    for name, (servers, trainers, extra) in PS_EARLY.items():
        runs[name] = early.root / "ps" / name
        procs = [
            early.process(
                f"ps-{name}-rank{rank}",
                ps_argv(store, runs[name], servers, trainers, *extra),
                {**early.env, **dist.as_environ()},
            )
            for rank, dist in enumerate(local_world(servers + trainers))
        ]
        for rank, process in enumerate(procs):
            assert process.wait(timeout=600) == 0, (early.root / f"ps-{name}-rank{rank}.log").read_text()[-3000:]
    return runs
