"""The parameter server and federated averaging with real RPC processes on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clipforge.hpc.distenv import local_world
from clipforge.models.builders import architecture, load_trained
from clipforge.preprocess.reader import ClipDataset
from clipforge.ps import worker

from .helpers import PS_SYNC_LR, PS_SYNC_STEPS, ps_argv, rows
from .helpers import PS_TINY as TINY

pytestmark = pytest.mark.checks_early


def start(
    store: Path, run: Path, servers: int, trainers: int, *extra: str, model: list[str] = TINY
) -> list[subprocess.Popen]:
    """One process per rank, as Slurm or torchrun would start them.

    No MPI: a dead rank must not take the others down.
    """
    procs = []
    for rank, dist in enumerate(local_world(servers + trainers)):
        log = open(run.parent / f"{run.name}-rank{rank}.log", "w")
        argv = ps_argv(store, run, servers, trainers, *extra, model=model)
        procs.append(
            subprocess.Popen(argv, env={**os.environ, **dist.as_environ()}, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


@pytest.fixture(scope="module")
def ps_runs(early) -> dict[str, Path]:
    """The runs that are only read once finished (helpers.PS_EARLY), run beside the rest of the suite."""
    return early.result("ps")


def finish(procs: list[subprocess.Popen], run: Path, timeout: float = 300) -> None:
    for rank, p in enumerate(procs):
        code = p.wait(timeout=timeout)
        assert code == 0, (run.parent / f"{run.name}-rank{rank}.log").read_text()[-3000:]


def test_one_server_two_async_trainers_lower_the_loss_and_leave_a_run_directory(ps_runs) -> None:
    run = ps_runs["async"]
    losses = [r["loss"] for r in rows(run, "train")]
    # Halves of 40 rows, not of 8: the two trainers' rows interleave as the server's timing falls,
    # and one tiny batch's loss swings by half its value (halves of 4 rows each once ended 1.59 after 1.47).
    half = len(losses) // 2
    assert half >= 15 and np.mean(losses[half:]) < np.mean(losses[:half]), losses
    summary = rows(run, "ps")[0]
    assert (
        summary["mode"] == "async"
        and summary["updates"] == 80
        and summary["clocks"] == {"trainer0": 40, "trainer1": 40}
    )
    model, record = load_trained(run)  # what evaluate.py and the registry read
    assert record.parameter_server["updates"] == 80 and (run / "plots" / "curves.png").exists()


def test_two_servers_hold_each_parameter_once_and_the_assembled_model_is_theirs(ps_runs) -> None:
    run = ps_runs["two-servers"]
    final = load_file(str(run / "final" / "model.safetensors"))
    shards = [torch.load(run / "ps" / f"server-{k}.pt", weights_only=True)["params"] for k in range(2)]
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0]) | set(shards[1]) == set(final)
    assert all(len(shard) > 0 for shard in shards)
    for shard in shards:
        for name, value in shard.items():
            assert torch.equal(final[name], value)


def test_sync_mode_is_data_parallel_sgd(tiny_store: Path, ps_runs) -> None:
    run, steps, lr = ps_runs["sync"], PS_SYNC_STEPS, PS_SYNC_LR
    arch = architecture("videovit-tiny", 6, 8, 32, depth=1, tubelet=(2, 8, 8))
    model = arch.build(seed=0)
    dataset = ClipDataset(tiny_store, "train")
    shares = worker.partition(dataset.labels, 2, "iid", 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        grads = []
        for t in range(2):
            model.zero_grad()
            items = [dataset[int(i)] for i in worker.batch_indices(shares[t], step, 4, 0, t)]
            loss = torch.nn.functional.cross_entropy(
                model(torch.stack([c for c, _ in items])), torch.tensor([y for _, y in items])
            )
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(dim=0)
        optimizer.step()
    final = load_file(str(run / "final" / "model.safetensors"))
    for name, value in model.state_dict().items():
        assert torch.allclose(final[name], value, atol=1e-5), name


def test_ssp_never_applies_an_update_staler_than_its_bound(ps_runs) -> None:
    run = ps_runs["ssp"]
    summary = rows(run, "ps")[0]
    assert summary["max_clock_gap"] <= 1
    assert summary["clocks"] == {"trainer0": 16, "trainer1": 16}


def test_a_trainer_killed_mid_run_does_not_stop_the_job(tiny_store: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    procs = start(
        tiny_store,
        run,
        1,
        3,
        "--trainer.steps",
        "60",
        "--server.trainer-timeout-s",
        "3",
        "--server.mode",
        "ssp",
        "--server.staleness",
        "2",
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len(rows(run, "train")) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    procs[3].send_signal(signal.SIGKILL)
    procs[3].wait()
    finish(procs[:3], run)
    summary = rows(run, "ps")[0]
    assert (
        summary["clocks"]["trainer0"] == 60
        and summary["clocks"]["trainer1"] == 60
        and summary["clocks"]["trainer2"] < 60
    )
    assert (run / "final" / "model.safetensors").exists()
    assert "trainer2 silent for 3 s (presumed dead)" in (tmp_path / "run-rank0.log").read_text()


def test_a_restarted_job_continues_from_the_server_checkpoint_and_its_clocks(tiny_store: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("--trainer.steps", "60", "--server.checkpoint-every", "10")
    procs = start(tiny_store, run, 1, 2, *args)
    checkpoint = run / "ps" / "server-0.pt"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() or torch.load(checkpoint, weights_only=True)["version"] < 20:
        assert time.monotonic() < deadline and procs[0].poll() is None
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    saved = torch.load(checkpoint, weights_only=True)
    finish(start(tiny_store, run, 1, 2, *args), run)
    log = (tmp_path / "run-rank0.log").read_text()
    assert f"restored from {checkpoint} at version {saved['version']}" in log
    summary = rows(run, "ps")[-1]
    assert summary["clocks"] == {"trainer0": 60, "trainer1": 60}
    assert summary["updates"] == saved["version"] + (120 - sum(saved["clocks"].values()))


@pytest.mark.slurm
def test_a_parameter_server_job_runs_through_submitit_on_slurm_with_three_tasks(
    slurm, tiny_store: Path, tmp_path: Path
) -> None:
    from clipforge.hpc.launch import run_script

    run = tmp_path / "run"
    results = run_script(
        "clipforge.jobs.ps_train",
        [
            "--cluster",
            "dev",
            "--wait",
            "True",
            "--data.store",
            str(tiny_store),
            "--run-dir",
            str(run),
            "--servers",
            "1",
            "--trainers",
            "2",
            "--trainer.steps",
            "10",
            *TINY,
        ],
    )
    assert len(results) == 3 and results[0]["summary"]["clocks"] == {"trainer0": 10, "trainer1": 10}
    assert (run / "final" / "model.safetensors").exists()
