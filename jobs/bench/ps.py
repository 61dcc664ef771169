#!/usr/bin/env python3
"""Benchmark of the parameter server: sync, SSP and async side by side with one trainer slowed down.

    python jobs/bench/ps.py [--trainers 3] [--steps 60] [--slow-factor 3]

Makes a small motion corpus, packs it, then trains the same model on the same
data with each consistency mode (1 server, N trainers, trainer 1 a straggler)
and prints updates/s, wall time, the time trainer 0's probes took to reach a
target accuracy, and the final accuracy, with ratios to sync.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tyro

from clipforge.hpc.distenv import local_world
from clipforge.hpc.mpi import mpiexec_command
from clipforge.preprocess import synthetic
from clipforge.rundir import RunDir


@dataclasses.dataclass
class Config:
    """Compare sync, ssp and async with a straggler."""

    trainers: int = 3
    """Trainer processes."""
    steps: int = 60
    """Iterations per trainer."""
    slow_factor: float = 3.0
    """How much slower trainer 1 is."""
    staleness: int = 2
    """SSP bound."""
    target: float = 0.3
    """Video top-1 whose time to reach is measured (trainer 0 probes every 10 iterations)."""


def run_mode(store: Path, run: Path, mode: str, cfg: Config) -> dict:
    procs = []
    started = time.perf_counter()
    for dist in local_world(1 + cfg.trainers):
        env = {**os.environ, **dist.as_environ()}
        run_flags = f"--servers 1 --trainers {cfg.trainers} --model.depth 1 --model.tubelet 4 16 16"
        server_flags = (
            f"--server.mode {mode} --server.staleness {cfg.staleness} --server.optimizer adamw --server.lr 0.001"
        )
        trainer_flags = (
            f"--trainer.steps {cfg.steps} --trainer.batch-per-rank 8 --trainer.slow-trainer 1 "
            f"--trainer.slow-factor {cfg.slow_factor} --trainer.probe-every 10"
        )
        flags = f"{run_flags} {server_flags} {trainer_flags}".split()
        where = ["--data.store", str(store), "--run-dir", str(run)]
        argv = [sys.executable, "-m", "clipforge.jobs.ps_train", *where, *flags]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{mode} run failed")
    wall = time.perf_counter() - started
    run_dir = RunDir(run)
    summary = run_dir.metrics("ps")[0]
    evaluation = run_dir.metrics("eval")[0]
    reached = [r["seconds"] for r in run_dir.metrics("probe") if r["video_top1"] >= cfg.target]
    return {
        "updates_per_s": summary["updates_per_s"],
        "wall_s": wall,
        "video_top1": evaluation["video_top1"],
        "clip_top1": evaluation["clip_top1"],
        "staleness": summary["staleness_histogram"],
        "to_target_s": min(reached) if reached else None,
    }


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-ps-") as tmp:
        work = Path(tmp)
        synthetic.make_corpus(work / "videos", videos_per_class=10, frames=(48, 64), seed=2)
        subprocess.run(
            [
                *mpiexec_command(2),
                sys.executable,
                "-m",
                "clipforge.jobs.preprocess",
                "--videos",
                str(work / "videos"),
                "--out",
                str(work / "store"),
                "--clip-frames",
                "16",
                "--height",
                "64",
                "--width",
                "64",
                "--split.train",
                "0.7",
                "--split.val",
                "0.3",
                "--split.test",
                "0",
            ],
            check=True,
            capture_output=True,
        )
        results = {mode: run_mode(work / "store", work / mode, mode, cfg) for mode in ("sync", "ssp", "async")}
    base = results["sync"]
    print(
        f"\n1 server, {cfg.trainers} trainers, trainer 1 slowed {cfg.slow_factor:g}x, {cfg.steps} iterations each, SSP "
        f"bound {cfg.staleness}\n"
    )
    print(
        f"{'mode':<6} {'updates/s':>10} {'vs sync':>8} {'wall s':>7} {f'to {cfg.target:.2f} s':>10} "
        f"{'video top-1':>12} {'vs sync':>8}  staleness histogram"
    )
    for mode, r in results.items():
        to_target = f"{r['to_target_s']:10.1f}" if r["to_target_s"] is not None else f"{'not reached':>10}"
        print(
            f"{mode:<6} {r['updates_per_s']:10.2f} {r['updates_per_s'] / base['updates_per_s']:7.2f}x "
            f"{r['wall_s']:7.1f} {to_target} "
            f"{r['video_top1']:12.3f} {100 * (r['video_top1'] - base['video_top1']):+7.1f}pt  {r['staleness']}"
        )
    print("\ngoal: ssp and async >= 1.5x the updates/s of sync, within 2 points of its accuracy")


if __name__ == "__main__":
    main(tyro.cli(Config))
