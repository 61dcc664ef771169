"""Jobs across nodes, and a node that dies mid-run, on a real 3-node Slurm cluster on this host."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clipforge.hpc.devcluster import LocalCluster
from clipforge.hpc.distenv import expand_nodelist, free_port

from .helpers import PS_TINY, TINY, TINY_MODEL, losses, multinode_env, options, rows, training_clips_loss

pytestmark = [pytest.mark.slurm, pytest.mark.waits]
REPO = Path(__file__).resolve().parents[1]
STEPS = 40


def train_args(store: Path, run: Path) -> list[str]:
    return [
        "--data.store",
        str(store),
        "--run-dir",
        str(run),
        "--steps",
        str(STEPS),
        "--eval-every",
        "1000",
        "--checkpoint-every",
        "10",
        "--parallel.zero-stage",
        "2",
        *TINY,
    ]


def sbatch_train(
    cluster: LocalCluster,
    store: Path,
    run: Path,
    *sbatch: str,
    train: tuple[str, ...] = (),
    tasks_per_node: int = 2,
    nodes: str = "2",
) -> str:
    """Submit a training job (2 nodes unless ``nodes`` says otherwise); returns its id."""
    argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
    argv += [f"--output={run.parent / (run.name + '.out')}", *sbatch]
    argv += [str(REPO / "jobs" / "train.py"), *train_args(store, run), *train]
    result = subprocess.run(argv, capture_output=True, text=True, env=multinode_env(cluster), check=True)
    return result.stdout.strip().split(";")[0]


def wait_for_job(cluster: LocalCluster, job: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    env = multinode_env(cluster)
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=env)
        if not state.stdout.strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job} still queued or running after {timeout:.0f} s")


def wait_for(ready, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.2)


def test_srun_over_three_nodes_gives_one_master_distinct_ranks_and_local_ranks_per_node(
    multinode: LocalCluster,
) -> None:
    result = subprocess.run(
        ["srun", "-N3", "--ntasks-per-node=2", sys.executable, "-m", "clipforge.jobs.selftest"],
        capture_output=True,
        text=True,
        timeout=120,
        env=multinode_env(multinode),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    pattern = re.compile(r"rank (\d+) of 6 \(local rank (\d+)\) on (\w+), master (\w+):\d+: all_reduce gave (\S+)")
    seen = {int(m[1]): (int(m[2]), m[3], m[4], m[5]) for m in pattern.finditer(result.stderr)}
    assert sorted(seen) == list(range(6))
    assert {rank: (local, host) for rank, (local, host, _, _) in seen.items()} == {
        0: (0, "n1"),
        1: (1, "n1"),
        2: (0, "n2"),
        3: (1, "n2"),
        4: (0, "n3"),
        5: (1, "n3"),
    }
    assert {master for _, _, master, _ in seen.values()} == {"n1"}  # the first node of the step's node list
    assert {total for _, _, _, total in seen.values()} == {"21"}  # 1 + 2 + ... + 6 over every node


def test_a_two_node_training_that_loses_a_node_is_requeued_and_trains_like_four_ranks_on_one_node(
    multinode: LocalCluster, mpiexec, tiny_store: Path, tmp_path: Path
) -> None:
    """One run checks both: its steps before the kill ran on two nodes, those after on the two left."""
    run = tmp_path / "run"
    job = sbatch_train(multinode, tiny_store, run, "--requeue", "--open-mode=append")
    env = multinode_env(multinode)
    wait_for(lambda: (run / "checkpoints" / "step-00000010" / "complete.json").exists(), "the first checkpoint")
    nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True, env=env).stdout
    victim = "n2" if "2" in nodes else "n3"
    killed = multinode.kill_node(victim)  # slurmd, slurmstepd and the job's tasks on it, by pid
    assert killed
    try:
        wait_for_job(multinode, job, timeout=300)
    finally:
        multinode.start_node(victim)  # ReturnToService=2: the node is IDLE again at once
    log = (tmp_path / "run.out").read_text()
    assert "re-launching under srun with 4 tasks" in log
    assert "resumed from checkpoint step-000000" in log and "(restart 1)" in log, log[-3000:]
    assert f"Node failure on {victim}" in log or "NODE_FAIL" in log or "node failure" in log.lower(), log[-3000:]
    # Nothing lost: every step is there, and every step, before the kill and after, is bitwise the step of four
    # ranks on one node that never stopped. Bitwise because each rank takes its share of its node's cores on both
    # sides (one thread: distenv.share_cores); with two threads a rank the last bits of the losses differed.
    one_node = tmp_path / "one-node"
    argv = [*mpiexec, "-n", "4", "-x", f"MASTER_PORT={free_port()}", sys.executable, "-m", "clipforge.jobs.train"]
    result = subprocess.run([*argv, *train_args(tiny_store, one_node)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = losses(run), losses(one_node)
    assert sorted(a) == list(range(1, STEPS + 1)) and a == b, (a, b)
    # 40 steps of ZeRO-2 learn: the final weights fit the training clips better than the start (1.82 -> 1.00).
    assert np.mean([a[s] for s in range(36, 41)]) < np.mean([a[s] for s in range(1, 6)]), a
    before, after = training_clips_loss(tiny_store, run / "final" / "model.safetensors")
    assert after < 0.9 * before, (before, after)
    # `clipforge jobs status` shows the requeue: a run ended by the node failure, then the one that finished.
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "jobs", "status", job]
    status = json.loads(subprocess.run(cli, capture_output=True, text=True, env=env, check=True).stdout)
    assert status["restarts"] == 1 and status["state"] == "COMPLETED", status
    first, last = status["runs"]
    assert first["state"] in ("NODE_FAIL", "REQUEUED") and victim in expand_nodelist(first["nodes"]), status
    assert last["state"] == "COMPLETED" and victim not in expand_nodelist(last["nodes"]), status


def test_a_host_that_cannot_make_the_nodes_is_refused_in_one_line() -> None:
    from clipforge.base.errors import UserError
    from clipforge.hpc.devcluster.nodes import NodeNetwork

    with pytest.raises(UserError, match="2 to 9 nodes") as too_many:
        NodeNetwork(12).check_host()
    with pytest.raises(UserError, match="already in use on this host; choose another with --subnet") as taken:
        NodeNetwork(3, prefix="cfx", subnet="127.0.0").check_host()  # lo holds 127.0.0.1
    assert "\n" not in str(too_many.value) + str(taken.value)


def test_a_pipeline_with_one_stage_per_node_trains_like_one_process(
    multinode: LocalCluster, mpiexec, tiny_store: Path, tmp_path: Path
) -> None:
    pipeline = ("--parallel.pipeline-stages", "2", "--parallel.partition-method", "uniform", "--steps", "8")
    clip = ("--optim.clip-grad", "0.05", "--parallel.zero-stage", "0")
    job = sbatch_train(multinode, tiny_store, tmp_path / "pipe", train=pipeline + clip, tasks_per_node=1)
    argv = [*mpiexec, "-n", "1", "-x", f"MASTER_PORT={free_port()}", sys.executable, "-m", "clipforge.jobs.train"]
    one = tmp_path / "one"
    argv += [*train_args(tiny_store, one), "--steps", "8", *clip]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    wait_for_job(multinode, job)
    log = (tmp_path / "pipe.out").read_text()
    pipe, single = losses(tmp_path / "pipe"), losses(one)
    assert len(pipe) == 8 and all(abs(pipe[s] - single[s]) < 1e-4 for s in single), log[-3000:]
    assert json.loads((tmp_path / "pipe" / "final" / "run.json").read_text())["world_size"] == 2


def test_submitit_from_the_login_side_starts_a_two_node_job(
    multinode: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clipforge.hpc.launch import run_script

    for key, value in multinode_env(multinode).items():
        monkeypatch.setenv(key, value)
    results = run_script(
        "clipforge.jobs.selftest", ["--cluster", "dev", "--nodes", "2", "--ntasks-per-node", "2", "--wait", "True"]
    )
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["master_addr"] for r in results} == {"n1"} and {r["all_reduce"] for r in results} == {10.0}
    assert sorted(r["local_rank"] for r in results) == [0, 0, 1, 1]


def test_a_parameter_server_job_finishes_without_the_trainers_of_a_dead_node(
    multinode: LocalCluster, tiny_store: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    argv = ["sbatch", "--parsable", "--no-kill", "-N2", "--ntasks-per-node=2", f"--output={tmp_path / 'ps.out'}"]
    argv += [str(REPO / "jobs" / "ps_train.py"), *options(data__store=tiny_store, run_dir=run, servers=1, trainers=3)]
    argv += ["--nodes", "2", *PS_TINY, "--trainer.steps", "60", "--server.trainer-timeout-s", "3"]
    env = multinode_env(multinode)
    job = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(rows(run, "train")) >= 2, "the first trainer updates")
    multinode.kill_node("n2")  # trainers 1 and 2 (ranks 2 and 3); the server and trainer 0 are on n1
    try:
        wait_for_job(multinode, job, timeout=300)
    finally:
        multinode.start_node("n2")
    log = (tmp_path / "ps.out").read_text()
    clocks = rows(run, "ps")[0]["clocks"]
    assert clocks["trainer0"] == 60 and clocks["trainer1"] < 60 and clocks["trainer2"] < 60, log[-3000:]
    assert "presumed dead" in log and (run / "final" / "model.safetensors").exists()


def test_a_federation_that_loses_a_node_mid_round_finishes_the_round_with_the_clients_left(
    multinode: LocalCluster, tiny_store: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # Tasks 0 and 1 (the server and client 0) on n1, tasks 2 and 3 (clients 1 and 2) on n2.
    argv = ["sbatch", "--parsable", "--no-kill", "-N2", "--ntasks-per-node=2", f"--output={tmp_path / 'fl.out'}"]
    argv += [str(REPO / "jobs" / "fl_train.py"), "--nodes", "2", "--ntasks-per-node", "2"]
    argv += [*options(data__store=tiny_store, run_dir=run, clients=3, min_clients=1, rounds=1, round_timeout_s=20)]
    argv += [*TINY_MODEL, "--batch-per-rank", "4"]
    env = multinode_env(multinode)
    job = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    logs = run / "flower" / "logs"

    def training_on_n2() -> bool:
        return all((logs / f"supernode-{i}.log").exists() for i in (1, 2)) and all(
            "Received successfully" in (logs / f"supernode-{i}.log").read_text(errors="replace") for i in (1, 2)
        )

    wait_for(training_on_n2, "the round's first message on n2's clients")
    multinode.kill_node("n2")
    try:
        wait_for_job(multinode, job, timeout=300)
    finally:
        multinode.start_node("n2")
    out = (tmp_path / "fl.out").read_text()
    flower = "".join(p.read_text() for p in logs.glob("run-*.log"))
    assert "sampled 3 clients" in flower and "aggregate_fit: received 1 results" in flower, flower
    assert [r["step"] for r in rows(run, "round")] == [1], out[-3000:]
    record = json.loads((run / "final" / "run.json").read_text())
    assert record["steps"] == 1 and record["federated"]["rounds"] == 1, record


def test_a_site_on_another_node_joins_a_federation_with_clipforge_fl_join(
    multinode: LocalCluster, tiny_store: Path, tmp_path: Path
) -> None:
    run, port = tmp_path / "run", free_port()
    # The server and client 0 on n1; client 1 is a site elsewhere: n2, which reaches n1 only through the network.
    argv = ["sbatch", "--parsable", "-N1", "-w", "n1", "--ntasks-per-node=2", f"--output={tmp_path / 'fl.out'}"]
    argv += [str(REPO / "jobs" / "fl_train.py"), "--nodes", "1", "--ntasks-per-node", "2", "--port", str(port)]
    argv += [*options(data__store=tiny_store, run_dir=run, clients=2, outside=1, min_clients=2, rounds=1)]
    argv += [*TINY_MODEL, "--batch-per-rank", "4"]
    env = multinode_env(multinode)
    job = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    wait_for(lambda: (run / "flower" / "superlink.json").exists(), "the federation's gate on n1", timeout=300)
    keys = run / "certs"
    join = ["srun", "-N1", "-n1", "-w", "n2", f"{sys.prefix}/bin/clipforge", "fl", "join", "--superlink", f"n1:{port}"]
    join += ["--ca", str(keys / "ca.crt"), "--key", str(keys / "client-1.key"), "--cert", str(keys / "client-1.crt")]
    join += ["--data.store", str(tiny_store), "--partition", "1/2", "--work", str(tmp_path / "site")]
    site = subprocess.Popen(join, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for_job(multinode, job, timeout=600)
        said, _ = site.communicate(timeout=180)  # it stops by itself once the federation's server is gone
    finally:
        site.kill()
    assert "joined the federation at n1:" in said and "is gone" in said, said
    flower = "".join(p.read_text() for p in (run / "flower" / "logs").glob("run-*.log"))
    assert "sampled 2 clients (out of 2)" in flower and "received 2 results" in flower, flower[-3000:]
    assert "is refused" not in flower
    assert [r["step"] for r in rows(run, "round")] == [1], (tmp_path / "fl.out").read_text()[-3000:]
    # The site's SuperNode spoke only to its own gate, which reached n1's gate with the site's certificate.
    served = (run / "flower" / "gate" / "access.log").read_text()
    assert "10.77.0.12 " in served and 'client="CN=client-1"' in served, served[-2000:]  # n2's address
