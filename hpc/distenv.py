"""The distributed contract: one place that turns the launcher's variables into
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.

Every job calls :func:`setup_distributed` (or :func:`dist_env`) first.
DeepSpeed asserts unless all five are set, and silently falls back to mpi4py
discovery when none are, so we always set all five.

Sources, first match wins:

1. an existing torchrun-style environment (all five already set);
2. a Slurm job step (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set by ``srun``);
3. submitit's local executor (``SUBMITIT_LOCAL_*``);
4. an MPI launcher (``mpiexec`` from Open MPI or MPICH);
5. a single process.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Mapping, MutableMapping

from submitit.slurm.slurm import _parse_node_list

from clipforge.base.errors import UserError

PORT_BASE = 20000
PORT_SPAN = 12000
"""Rendezvous ports stay in 20000-31999, below Linux's ephemeral range (32768 up by default): a job's
(:func:`master_port`) in the first half, one drawn for a rendezvous started by hand (:func:`free_port`) in the
second, so that a port held by one never is the other's.

A client that retries a not-yet-listening port inside the ephemeral range can be given that
same port as its own source port and connect to itself (TCP simultaneous open); it then reads
its own request back as the store's answer, and a gloo collective sized from it aborts with
``std::bad_alloc``.
"""


class LaunchError(UserError):
    """The launcher's environment is inconsistent; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    """The scheduler's job id (Slurm or submitit local), if any."""
    restart_count: int = 0
    """How often Slurm has requeued this job (``SLURM_RESTART_COUNT``)."""
    source: str = "single"
    """Where the values came from: torchrun, slurm, submitit-local, mpi or single."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def as_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def master_port(job_id: str | int, step_id: str | int = 0) -> int:
    """A port every rank of one job step derives alike, different for neighbouring jobs.

    >>> master_port(1234) == master_port("1234")
    True
    """
    return PORT_BASE + (int(job_id) * 8 + int(step_id)) % (PORT_SPAN // 2)


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for a rendezvous started by hand (tests, benchmarks, ``mpiexec``).

    Drawn below the ephemeral range (see ``PORT_SPAN``), so no client's own source port can be it, and above the
    ports jobs derive from their ids, so no job's rendezvous finds it taken.
    """
    low, top = PORT_BASE + PORT_SPAN // 2, min(PORT_BASE + PORT_SPAN, _ephemeral_low())
    for port in random.Random().sample(range(low, max(low, top)), max(0, min(200, top - low))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded host: fall back to one the kernel picks
        sock.bind((host, 0))
        return sock.getsockname()[1]


def given_port(environ: Mapping[str, str] | None = None, default: int | None = None) -> int | None:
    """``MASTER_PORT`` as whoever started this process set it, or ``default`` where it is unset or empty.

    Anything but a port number is refused in one line here; taken as it is, it would fail at the rendezvous, on
    every rank, as a traceback.
    """
    value = (os.environ if environ is None else environ).get("MASTER_PORT", "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) > 65535:
        raise LaunchError(f"MASTER_PORT={value!r} is not a port number: set it to a free TCP port or unset it")
    return int(value)


def local_world(world_size: int, port: int | None = None) -> list[DistEnv]:
    """The ranks of ``world_size`` processes on this host, numbered as torchrun would number them."""
    port = port or free_port()
    return [DistEnv(r, world_size, r, "127.0.0.1", port, source="torchrun") for r in range(world_size)]


def expand_nodelist(nodelist: str) -> list[str]:
    """``node[01-03],gpu7`` -> ``['node01', 'node02', 'node03', 'gpu7']`` (submitit's parser)."""
    return _parse_node_list(nodelist)


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Derive the distributed environment from whatever launched this process."""
    env = os.environ if environ is None else environ
    restarts = int(env.get("SLURM_RESTART_COUNT", 0) or 0)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return DistEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env["LOCAL_RANK"]),
            env["MASTER_ADDR"],
            given_port(env, 29500),
            env.get("SLURM_JOB_ID"),
            restarts,
            "torchrun",
        )
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        job_id = env["SLURM_JOB_ID"]
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
            local_rank=int(env["SLURM_LOCALID"]),
            master_addr=expand_nodelist(nodes)[0],
            master_port=master_port(job_id, env["SLURM_STEP_ID"]),
            job_id=job_id,
            restart_count=restarts,
            source="slurm",
        )
    if "SUBMITIT_LOCAL_JOB_ID" in env:
        job_id = env["SUBMITIT_LOCAL_JOB_ID"]
        return DistEnv(
            rank=int(env["SUBMITIT_LOCAL_GLOBALID"]),
            world_size=int(env["SUBMITIT_LOCAL_NTASKS"]),
            local_rank=int(env["SUBMITIT_LOCAL_LOCALID"]),
            master_addr="127.0.0.1",
            # Set by the submitter (clipforge.hpc.launch.local_port), checked free; derived for older submissions.
            master_port=given_port(env, master_port(job_id)),
            job_id=job_id,
            source="submitit-local",
        )
    for rank_key, size_key, local_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ):
        if rank_key in env and size_key in env:
            return DistEnv(
                rank=int(env[rank_key]),
                world_size=int(env[size_key]),
                local_rank=int(env.get(local_key, env[rank_key])),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=given_port(env, 29500),
                source="mpi",
            )
    return DistEnv(0, 1, 0, "127.0.0.1", given_port(env, 29500), source="single")


def setup_distributed(environ: MutableMapping[str, str] | None = None) -> DistEnv:
    """Derive the distributed environment and export the five variables; in this process's own environment, also
    take this rank's share of the cores (:func:`share_cores`)."""
    env = os.environ if environ is None else environ
    dist = dist_env(env)
    env.update(dist.as_environ())
    if environ is None:  # this process's own environment: its threads too
        share_cores()
    return dist


def ranks_on_this_node(environ: Mapping[str, str] | None = None) -> int:
    """How many ranks of this job run on this node, by whatever launched them; 1 when nothing says."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SUBMITIT_LOCAL_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    # Slurm: "2(x3),1" is two tasks on each of the first three nodes, then one; SLURM_NODEID picks this node's.
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, layout.split(",")):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    node = int(env.get("SLURM_NODEID", 0) or 0)
    return counts[node] if node < len(counts) else max(counts, default=1)


def share_cores(environ: MutableMapping[str, str] | None = None, ranks: int | None = None) -> int:
    """Give this rank its share of the CPU threads, as ``torchrun`` does; returns the threads it keeps.

    A rank that sees every core of its node (no Slurm CPU binding, the local executor) would otherwise start
    as many threads as the node has cores, and N ranks would run N times that many: two ranks of two threads
    each on two cores took five times as long per step as two of one thread. ``OMP_NUM_THREADS``, where it is
    set, wins; ``SLURM_CPUS_PER_TASK`` bounds a task; a rank bound to fewer cores than the node has keeps
    them all. A lowered count is exported, so the rank's own child processes inherit it (a process alone on its
    node exports nothing: the ranks it may launch take their own shares). ``ranks`` counts the
    processes that share the node where the launcher does not know them (a one-task federation's clients).
    """
    import torch

    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").isdigit():
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = cores if cores < (os.cpu_count() or cores) else max(1, cores // (ranks or ranks_on_this_node(env)))
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        threads = min(threads, int(env["SLURM_CPUS_PER_TASK"]))
    if threads < torch.get_num_threads():  # never more than torch chose (1 under Open MPI, from its variables)
        torch.set_num_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    return torch.get_num_threads()


def check_mpi_world(comm_size: int, environ: Mapping[str, str] | None = None) -> None:
    """Fail when MPI sees fewer ranks than Slurm started.

    With ``srun --mpi=none`` every task comes up as its own MPI world of size 1,
    and a job would silently do the same work N times.
    """
    env = os.environ if environ is None else environ
    slurm_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if "SLURM_STEP_ID" in env and slurm_tasks and int(slurm_tasks) != comm_size:
        raise LaunchError(
            f"Slurm started {slurm_tasks} tasks but MPI sees a world of {comm_size}: "
            "launch with `srun --mpi=pmix` (Open MPI) or `srun --mpi=pmi2` (MPICH), not --mpi=none"
        )


def cuda_index(local_rank: int, visible: int) -> int | None:
    """The CUDA device index this task should use, from the GPUs it can see; None when it sees none.

    Under ``srun --gpus-per-task=1`` (or ``--gpu-bind``) every task sees exactly one GPU,
    as ``cuda:0`` whatever its local rank; when all the node's GPUs are visible, the
    local rank picks one. Fewer visible GPUs than that would put two ranks on one GPU.
    """
    if visible <= 0:
        return None
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise LaunchError(
        f"local rank {local_rank} sees only {visible} GPUs (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): ask for as many GPUs per node as tasks per node, "
        "or one GPU per task (--gpus-per-task 1)"
    )


def task_device(env: DistEnv):
    """The torch device of this task, made the current CUDA device before any process group starts."""
    import torch

    index = cuda_index(env.local_rank, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if index is None:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device():
    """Where a tensor entering a collective must live: the current GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(env: DistEnv, device, single: bool = False, timeout_s: float = 600) -> bool:
    """Start the default process group (NCCL on GPUs, else gloo); the one place a job starts one.

    A job of one rank gets none (False) unless ``single``: DeepSpeed wants a group even then. Call
    :func:`task_device` first: NCCL binds each rank to the current device. DeepSpeed adopts the group
    this starts (``deepspeed.initialize`` wraps an initialised default group instead of making its own).
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized() or (env.world_size == 1 and not single):
        return dist.is_initialized()
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        raise LaunchError(
            f"rank {env.rank} cannot listen on port {env.master_port} for the rendezvous: another process has it; "
            "set MASTER_PORT to a free port (a local job picks a free one when MASTER_PORT is unset)"
        ) from None
    return True


_waits: dict[str, int] = {}


def wait_for_ranks(name: str, poll_s: float = 1.0) -> None:
    """A barrier with no timeout, for ranks that wait on one another's uneven work (rank 0 writing the run's
    final files, the last rank's share of a million videos): each rank counts itself in at the group's
    rendezvous store and polls it. A collective barrier would fail them after the group's timeout (600 s),
    which one rank's extra work may pass on a large job; the job's own time limit bounds this one.
    """
    import time

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store torch's own barrier-free waits use
    _waits[name] = _waits.get(name, 0) + 1  # every rank waits in the same order: the n-th wait of a name has one key
    key = f"clipforge/wait/{name}/{_waits[name]}"
    arrived = store.add(key, 1)
    while arrived < dist.get_world_size():
        time.sleep(poll_s)
        arrived = store.add(key, 0)
    # Every rank is here: a barrier now returns at once, and keeps rank 0 (the store's host) from leaving while
    # another rank is still between two polls of it.
    dist.barrier()
