"""The distributed contract, as pure logic over environment mappings."""

from __future__ import annotations

import os
import socket

import pytest

from clipforge.hpc.distenv import (
    LaunchError,
    check_mpi_world,
    collective_device,
    cuda_index,
    dist_env,
    expand_nodelist,
    master_port,
    ranks_on_this_node,
    setup_distributed,
    share_cores,
    task_device,
)
from clipforge.hpc.launch import context

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[007-008,010],login1",
    "SLURM_STEP_NODELIST": "gpu[008,010]",
    "SLURM_RESTART_COUNT": "2",
}


def test_node_lists_expand_ranges_padding_and_groups() -> None:
    assert expand_nodelist("gpu[007-008,010],login1") == ["gpu007", "gpu008", "gpu010", "login1"]
    assert expand_nodelist("node1") == ["node1"]


def test_master_port_is_the_same_for_every_rank_and_differs_between_jobs() -> None:
    assert master_port("4242") == master_port(4242)
    assert master_port(4242) != master_port(4243)
    assert master_port(4242, step_id=0) != master_port(4242, step_id=1)
    assert all(20000 <= master_port(j) < 60000 for j in range(0, 10**6, 9973))


def test_a_slurm_step_gives_all_five_variables() -> None:
    env = dict(SLURM_STEP)
    dist = setup_distributed(env)
    assert (dist.rank, dist.world_size, dist.local_rank, dist.restart_count) == (5, 8, 1, 2)
    assert dist.master_addr == "gpu008"  # first host of the step, not of the job
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "gpu008" and env["MASTER_PORT"] == str(master_port(4242, 0))
    assert dist.source == "slurm"


def test_an_existing_torchrun_environment_is_kept() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    dist = dist_env({**SLURM_STEP, **env})
    assert (dist.rank, dist.world_size, dist.master_addr, dist.master_port, dist.source) == (
        3,
        4,
        "10.0.0.1",
        29400,
        "torchrun",
    )


def test_submitit_local_tasks() -> None:
    env = {
        "SUBMITIT_LOCAL_JOB_ID": "777",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_LOCALID": "1",
    }
    dist = dist_env(env)
    assert (dist.rank, dist.world_size, dist.master_addr, dist.master_port) == (1, 2, "127.0.0.1", master_port(777))
    # The submitter's port, checked free when it submitted (clipforge.hpc.launch.local_port), wins.
    assert dist_env({**env, "MASTER_PORT": "23456"}).master_port == 23456


def test_a_local_job_takes_the_submitters_master_port_or_one_free_now() -> None:
    from clipforge.hpc.launch import local_port

    assert local_port({"MASTER_PORT": "23456"}) == 23456
    port = local_port({})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free: nothing listens there


def test_the_ranks_on_this_node_come_from_the_launcher() -> None:
    slurm = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert [ranks_on_this_node({**slurm, "SLURM_NODEID": str(n)}) for n in range(4)] == [2, 2, 2, 1]
    assert ranks_on_this_node({"SLURM_TASKS_PER_NODE": "4"}) == 4  # a batch script, outside any step
    assert ranks_on_this_node({**slurm, "LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun inside an allocation
    assert ranks_on_this_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert ranks_on_this_node({"SUBMITIT_LOCAL_NTASKS": "2"}) == 2 and ranks_on_this_node({}) == 1


def test_a_rank_takes_its_share_of_the_cores_and_a_process_alone_exports_nothing() -> None:
    import subprocess
    import sys

    alone: dict[str, str] = {}
    share_cores(alone)  # this process, alone on its node: it keeps its threads and its children choose their own
    assert "OMP_NUM_THREADS" not in alone
    code = (
        "import os; from clipforge.hpc.distenv import share_cores; print(share_cores(), os.environ['OMP_NUM_THREADS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    for ranks, launcher in ((2, {"SUBMITIT_LOCAL_NTASKS": "2"}), (cores, {"LOCAL_WORLD_SIZE": str(cores)})):
        ran = subprocess.run([sys.executable, "-c", code], env={**env, **launcher}, capture_output=True, text=True)
        share = max(1, cores // ranks)
        assert ran.stdout.split() == [str(share), str(share)] or cores < 2, ran.stdout + ran.stderr


@pytest.mark.parametrize("value", ["29500x", "-1", "70000"])
def test_a_master_port_that_is_no_port_number_is_refused_in_one_line(value: str) -> None:
    from clipforge.hpc.launch import local_port

    slurm = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    for env in ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, {}, {"SUBMITIT_LOCAL_JOB_ID": "7"}):
        with pytest.raises(LaunchError, match=f"MASTER_PORT='{value}' is not a port number: set it to a free"):
            dist_env(
                {
                    **env,
                    "MASTER_PORT": value,
                    "SUBMITIT_LOCAL_GLOBALID": "0",
                    "SUBMITIT_LOCAL_NTASKS": "1",
                    "SUBMITIT_LOCAL_LOCALID": "0",
                }
            )
    with pytest.raises(LaunchError, match="is not a port number"):
        local_port({"MASTER_PORT": value})
    # 0 is a port number (the system picks one), and a Slurm step derives its port from the job id, never reading
    # MASTER_PORT.
    assert (
        dist_env(
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "0"}
        ).master_port
        == 0
    )
    assert dist_env({**slurm, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "MASTER_PORT": value}).rank == 0


def test_mpiexec_ranks() -> None:
    dist = dist_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (dist.rank, dist.world_size, dist.local_rank, dist.source) == (1, 4, 1, "mpi")


def test_no_launcher_is_a_single_process() -> None:
    dist = dist_env({})
    assert (dist.rank, dist.world_size, dist.local_rank, dist.source) == (0, 1, 0, "single")


def test_an_mpi_world_smaller_than_the_slurm_step_is_refused() -> None:
    with pytest.raises(LaunchError, match="Slurm started 8 tasks but MPI sees a world of 1"):
        check_mpi_world(1, SLURM_STEP)
    check_mpi_world(8, SLURM_STEP)


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "login"),
        ({"SLURM_JOB_ID": "1", "ENVIRONMENT": "BATCH", "SLURM_PROCID": "0"}, "batch"),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}, "allocation"),
        (SLURM_STEP, "rank"),
        ({"SUBMITIT_LOCAL_JOB_ID": "3"}, "rank"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "rank"),
    ],
)
def test_a_job_script_knows_where_it_was_started(env: dict, expected: str) -> None:
    assert context(env) == expected


def test_a_task_that_sees_one_gpu_uses_cuda_0_and_one_that_sees_all_uses_its_local_rank() -> None:
    assert cuda_index(local_rank=3, visible=0) is None  # no GPU: the CPU path
    assert cuda_index(local_rank=3, visible=1) == 0  # srun --gpus-per-task=1 / --gpu-bind: one GPU, always cuda:0
    assert [cuda_index(r, visible=4) for r in range(4)] == [0, 1, 2, 3]  # all the node's GPUs visible
    with pytest.raises(LaunchError, match=r"local rank 2 sees only 2 GPUs .*--gpus-per-task 1"):
        cuda_index(local_rank=2, visible=2)  # two ranks would share a GPU


def test_without_visible_gpus_every_rank_of_a_slurm_step_gets_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # whether or not this host has a GPU
    dist = dist_env(SLURM_STEP)  # local rank 1
    assert str(task_device(dist)) == "cpu" and str(collective_device()) == "cpu"


def test_with_four_visible_gpus_a_rank_takes_the_one_of_its_local_rank_and_makes_it_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the same on a host with no GPU or with one
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    dist = dist_env(SLURM_STEP)  # local rank 1
    assert task_device(dist) == torch.device("cuda", 1) and current == [1]


WAITS = """
import datetime, sys, time
import torch.distributed as dist
from clipforge.hpc.distenv import wait_for_ranks
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1))
for i in range(2):
    started = time.monotonic()
    if dist.get_rank() == 0:
        time.sleep(2.5)  # rank 0's own work, past the group's 1-second timeout
    wait_for_ranks("finished", poll_s=0.1)
    print(i, round(time.monotonic() - started, 1), flush=True)
dist.barrier()
"""


def test_waiting_for_ranks_outlasts_the_groups_timeout_and_each_wait_is_its_own() -> None:
    """Two real gloo ranks: rank 1 waits 2.5 s for rank 0, twice, where a barrier would fail after the 1-s timeout."""
    import subprocess
    import sys

    from clipforge.hpc.distenv import free_port

    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WAITS],
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    waited = [float(line.split()[1]) for line in outputs[1][0].splitlines()]
    assert len(waited) == 2 and all(w >= 2.0 for w in waited), outputs  # the second wait did not pass at once
