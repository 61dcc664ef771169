"""Job scripts that run the way the cluster works.

A file under ``jobs/`` is a Python module with ``#SBATCH`` lines at the top
and a :class:`JobSpec` named ``SPEC``: its module name, ``parse(argv) ->
config``, ``main(config)``, an optional ``check(config)`` that refuses a
config before anything is submitted, and whether its ranks are MPI ranks.
The config has a ``launch`` section (:class:`Launch`) and a ``resources``
section whose defaults are the ``#SBATCH`` lines (a test keeps the two
equal). :func:`run_script` decides what running a job means from where it
was started:

=====================  ================================================================
started by             what happens
=====================  ================================================================
``sbatch job.py``      the batch step re-launches the module under ``srun`` with the
                       job's tasks (``python -m``: the spooled copy of the script is on
                       the first node only)
``salloc``, then       one task: runs here, in the foreground (``pdb`` works);
``python job.py``      more tasks: ``srun`` in the foreground, logs on the terminal
``srun``, submitit,    this process is one rank: call ``main`` directly
torchrun, ``mpiexec``
a login node or a      submits itself through submitit (``slurm``, ``local`` or
workstation            ``debug`` executor) with the resources from its options
=====================  ================================================================
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import submitit

from clipforge.base.errors import UserError
from clipforge.base.logs import ERROR_PREFIX, failure_reason, setup_logging

from .distenv import LaunchError, free_port, given_port
from .executor import job_logs, make_executor, submit
from .mpi import mpiexec_command
from .processes import process_alive, process_tree
from .profile import ClusterProfile, load_profile
from .requeue import RequeueableJob
from .resources import Resources

log = logging.getLogger(__name__)

Context = Literal["rank", "batch", "allocation", "login"]


@dataclasses.dataclass
class Launch:
    """How a job script is launched (its resources are a separate section)."""

    cluster: str | None = None
    """Cluster profile name or YAML path; default $CLIPFORGE_CLUSTER or local."""
    executor: Literal["slurm", "local", "debug"] | None = None
    """Override the profile's executor: slurm, local (processes here) or debug (this process)."""
    wait: bool | None = None
    """Wait for the job and print its result; default: wait unless submitting to Slurm."""
    max_requeues: int | None = None
    """Requeues allowed after timeout or preemption; default: the profile's."""

    def profile(self) -> ClusterProfile:
        return load_profile(self.cluster)

    def requeues(self, profile: ClusterProfile | None = None) -> int:
        """How many times the job may be requeued: ``--max-requeues``, else the profile's bound."""
        if self.max_requeues is not None:
            return self.max_requeues
        return (profile or self.profile()).max_requeues


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What every job module declares, as ``SPEC``: the one contract the launcher and the CLI use."""

    module: str
    """The importable module name (``clipforge.jobs.train``): a node imports it again by this name."""
    parse: Callable[[list[str]], Any]
    """Command line to config; the config has ``launch`` and ``resources`` sections."""
    main: Callable[[Any], Any]
    """Run one rank (or the whole job, for a single task)."""
    check: Callable[[Any], None] | None = None
    """Refuse a config that cannot work, before it is submitted or waits in the queue."""
    uses_mpi: bool = False
    """Its ranks are MPI ranks (the local executor starts them with mpiexec)."""
    survives_lost_ranks: bool = False
    """The job carries on when some of its ranks die, a node's worth included (the parameter server):
    its step runs with ``srun --no-kill`` and without ``--kill-on-bad-exit``. Other jobs stop at a lost
    rank, and Slurm requeues them to resume from their checkpoint."""

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    def default_resources(self) -> Resources:
        """The resources of the job started with no options: what its ``#SBATCH`` lines must say."""
        return self.parse([]).resources


def job_spec(module: str) -> JobSpec:
    """The :class:`JobSpec` of job module ``module``."""
    spec = getattr(importlib.import_module(module), "SPEC", None)
    if not isinstance(spec, JobSpec):
        raise LaunchError(f"{module} is not a job module: it declares no SPEC = JobSpec(...)")
    return spec


def context(environ: dict[str, str] | None = None) -> Context:
    """Where this process stands: a rank of a job, a batch script, inside salloc, or outside Slurm."""
    env = os.environ if environ is None else environ
    if any(k in env for k in ("SLURM_STEP_ID", "SUBMITIT_LOCAL_JOB_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return "rank"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "rank"
    if "SLURM_JOB_ID" in env:
        return "batch" if env.get("ENVIRONMENT") == "BATCH" else "allocation"
    return "login"


class ScriptJob(RequeueableJob):
    """A job module and its command line, submitted as one picklable, requeueable job.

    Only strings cross to the node: the module is imported there and the command
    line parsed again, so the node needs clipforge installed, not this process's objects.
    """

    def __init__(self, module: str, argv: list[str], max_requeues: int = 3, mpi_tasks: int = 0) -> None:
        super().__init__(max_requeues)
        self.module = module
        self.argv = list(argv)
        self.mpi_tasks = mpi_tasks
        """When set, start that many MPI ranks with mpiexec (local executor: no srun to do it)."""
        self.master_port = 0
        """When set, the tasks' rendezvous port (local executor: chosen free at submission, see :func:`local_port`)."""

    def run(self) -> Any:
        if self.master_port:
            os.environ["MASTER_PORT"] = str(self.master_port)
        if self.mpi_tasks:
            command = [*mpiexec_command(self.mpi_tasks), sys.executable, "-u", "-m", self.module, *self.argv]
            code = subprocess.run(command, check=False).returncode
            if code:  # the ranks said why above, in their one line or their traceback
                raise RuntimeError(f"{self.module} under mpiexec -n {self.mpi_tasks} exited with {code}")
            return code
        spec = job_spec(self.module)
        try:
            return spec.main(spec.parse(self.argv))
        except UserError as exc:
            # Said in one line where the submitter and `clipforge jobs status` look for the reason.
            print(f"{ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
            raise

    def __repr__(self) -> str:
        return f"ScriptJob({self.module} {' '.join(self.argv)})"


def run_script(module: str, argv: list[str] | None = None) -> Any:
    """Run job module ``module`` with command line ``argv`` the way its context asks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    spec = job_spec(module)
    cfg = spec.parse(argv)
    where = context()
    if where == "rank":
        return spec.main(cfg)
    setup_logging()
    if spec.check is not None:
        spec.check(cfg)  # fail here, in one line, not in a job that waited in the queue
    launch: Launch = cfg.launch
    profile = launch.profile()
    if where == "batch":
        return _srun(spec, argv, profile, int(os.environ.get("SLURM_NTASKS", 1)), replace=True)
    if where == "allocation":
        ntasks = int(os.environ.get("SLURM_NTASKS", 1))
        if ntasks == 1:
            log.info("inside allocation %s with one task: running in the foreground", os.environ["SLURM_JOB_ID"])
            return spec.main(cfg)
        return _srun(spec, argv, profile, ntasks, replace=False)
    return submit_script(spec, argv, cfg.resources, launch, profile)


def submit_script(spec: JobSpec, argv: list[str], resources: Resources, launch: Launch, profile: ClusterProfile) -> Any:
    """Submit the job module through submitit and, if asked, wait for its results."""
    kind = launch.executor or profile.executor
    job_object = ScriptJob(spec.module, argv, launch.requeues(profile))
    if kind == "local" and spec.uses_mpi and resources.ntasks > 1:
        # Local tasks are not MPI ranks: one task starts the ranks with mpiexec.
        job_object.mpi_tasks = resources.ntasks
        resources = dataclasses.replace(resources, ntasks_per_node=1)
    if kind == "local" and resources.ntasks > 1:
        job_object.master_port = local_port()
    executor = make_executor(resources, profile, kind)
    job = submit(executor, job_object, name=spec.name)
    log.info("submitted %s as job %s (%s executor); logs: %s", spec.module, job.job_id, kind, job.paths.stdout)
    wait = launch.wait if launch.wait is not None else kind != "slurm"
    if not wait:
        print(f"job {job.job_id} submitted; follow it with: clipforge jobs logs {job.job_id}")
        return job
    if kind == "local":
        _follow(job, stop_on_failure=resources.ntasks > 1 and not spec.survives_lost_ranks)
    try:
        results = job.results()
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
        raise LaunchError(job_failure(job, str(exc))) from None
    return results[0] if len(results) == 1 else results


def local_port(environ: dict[str, str] | None = None) -> int:
    """The rendezvous port of a local job's tasks: ``MASTER_PORT`` if the submitter set one, else one free now.

    Slurm jobs derive theirs from the job id on every node alike (:func:`~clipforge.hpc.distenv.master_port`);
    local tasks share this host with whatever else listens on it, so the port is checked free at submission
    instead of derived (a derived one can be taken, and the job then fails at its rendezvous).
    """
    port = given_port(environ)
    return free_port() if port is None else port


def job_failure(job: submitit.Job, fallback: str = "") -> str:
    """``job N failed: <its own one-line reason>; full log: <path>``."""
    last = [line.strip() for line in fallback.splitlines() if line.strip()][-1:] or ["no reason in its log"]
    reason = failure_reason(job_logs(str(job.paths.folder))) or last[0]
    return f"job {job.job_id} failed: {reason}; full log: {job.paths.stderr}"


_FAILED_MARK = b"Submitted job triggered an exception"
"""What submitit logs before the traceback of a job that raised: the terminal gets the reason instead."""


def _follow(job: submitit.Job, stop_on_failure: bool = False) -> None:
    """Echo rank 0's log while a local job runs, so progress shows on the terminal as it happens.

    The echo stops where submitit reports that the job raised: its traceback stays in the log,
    and the submitter prints the job's own one-line reason and the log's path. With
    ``stop_on_failure``, a task that raised stops the job's other tasks, as ``srun
    --kill-on-bad-exit`` does under Slurm: they would otherwise wait at their next collective (or
    their rendezvous) for the whole process-group timeout.
    """
    paths = [Path(str(job.paths.stderr).replace("%t", "0")), Path(str(job.paths.stdout).replace("%t", "0"))]
    offsets = {p: 0 for p in paths}
    ended: set[Path] = set()

    def echo() -> None:
        for path in paths:
            if path in ended:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk.rfind(b"\n") + 1  # whole lines only
            if not complete:
                continue
            chunk = chunk[:complete]
            offsets[path] += complete
            mark = chunk.find(_FAILED_MARK)
            if mark >= 0:
                chunk = chunk[: chunk.rfind(b"\n", 0, mark) + 1]
                ended.add(path)
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()

    while not job.done():
        echo()
        failed = _failed_task(job) if stop_on_failure else None
        if failed is not None:
            log.error("job %s: task %d failed; stopping its other tasks", job.job_id, failed)
            _stop_tasks(job)
            stop_on_failure = False
        time.sleep(1.0)
    echo()


def _stop_tasks(job: submitit.Job) -> None:
    """Stop the tasks of a local job (the processes running ``submitit.core._submit`` under it).

    Not ``job.cancel()``: that interrupts submitit's controller, whose traceback lands on the terminal. Once
    its tasks have exited, the controller ends on its own and the job's results say what failed.
    """
    tasks = []
    for pid in process_tree(int(job.job_id)):
        try:
            if b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes():
                tasks.append(pid)
        except OSError:  # gone meanwhile
            continue
    # As submitit's controller stops tasks: SIGINT, then SIGKILL for a task blocked in C++ (a rendezvous).
    for sig, grace_s in ((signal.SIGINT, 2.0), (signal.SIGKILL, 0.0)):
        for pid in tasks:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_alive(pid) for pid in tasks):
            time.sleep(0.1)


def _failed_task(job: submitit.Job) -> int | None:
    """The first task of a running local job whose result says it raised, if any."""
    from submitit.core.utils import JobPaths

    for task in range(job.num_tasks):
        path = JobPaths(job.paths.folder, job.job_id, task).result_pickle
        if path.exists():
            try:
                outcome = submitit.core.utils.pickle_load(path)[0]
            except (OSError, EOFError, ValueError, IndexError, pickle.UnpicklingError):  # being written: again later
                continue
            if outcome == "error":
                return task
    return None


def _srun(spec: JobSpec, argv: list[str], profile: ClusterProfile, ntasks: int, replace: bool) -> Any:
    # A lost rank stops the step (and a node failure requeues the job) unless the job carries on without it.
    kill = ["--no-kill", "--kill-on-bad-exit=0"] if spec.survives_lost_ranks else ["--kill-on-bad-exit=1"]
    command = ["srun", f"--ntasks={ntasks}", *kill]
    setup = profile.setup_lines()
    if setup:
        # Setup lines come from the profile file; the user's arguments stay positional, never shell text.
        command += ["bash", "-c", "\n".join(setup) + '\nexec "$@"', "clipforge-setup"]
    command += [profile.python, "-u", "-m", spec.module, *argv]
    log.info("re-launching under srun with %d tasks", ntasks)
    sys.stdout.flush()
    sys.stderr.flush()
    if replace:
        os.execvp(command[0], command)
    return subprocess.run(command, check=False).returncode
