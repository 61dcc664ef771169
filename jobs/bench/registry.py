#!/usr/bin/env python3
"""Benchmark of the registry: push and pull of a large weights file against ``cp``, and ``list`` at 1,000 versions.

    python jobs/bench/registry.py [--size-mb 500] [--versions 1000]

Runs against a bare repository on the local disk (the shared-filesystem case).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import tyro

from clipforge.registry.repo import Ref, Registry
from clipforge.rundir import HEADLINE_METRICS, InputShape, RunDir, RunRecord


@dataclasses.dataclass
class Config:
    """Measure registry push, pull and list."""

    size_mb: int = 500
    """Size of the weights file."""
    versions: int = 1000
    """Versions in the registry for the list figure."""


def fake_run(folder: Path, size_mb: int) -> RunDir:
    """A finished run whose weights are ``size_mb`` MB of random bytes, written by the run directory's own writer."""
    state = {"weights": torch.randint(0, 256, (size_mb << 20,), dtype=torch.uint8)}
    metrics = {"clip_top1": 0.5, "clip_top5": 1.0, "video_top1": 0.5, "video_top5": 1.0, "loss": 1.0}
    metrics.update(split="val", per_class_accuracy={"a": 0.5, "b": 0.5})
    record = RunRecord(
        model="videovit-base",
        architecture={},
        classes=["a", "b"],
        input=InputShape(16, 224, 224),
        crop=None,
        store="store",
        data_fingerprint={},
        metrics={k: metrics[k] for k in HEADLINE_METRICS},
        metrics_split="val",
        per_class_accuracy=metrics["per_class_accuracy"],
        steps=1,
        world_size=1,
    )
    run = RunDir(folder)
    run.write_config({"steps": 1})
    run.write_final(state, record, metrics)
    return run


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-registry-") as tmp:
        work = Path(tmp)
        os.environ.update(HOME=str(work), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=str(work / ".gitconfig"))
        run = fake_run(work / "run", cfg.size_mb)
        weights = run.weights
        cp = timed(lambda: shutil.copyfile(weights, work / "copy.bin"))
        registry = Registry.init(str(work / "remote.git"))
        push = timed(lambda: registry.push(run.root, "big"))
        pull = timed(lambda: registry.pull(Ref.parse("big@v1"), work / "pulled"))
        _many_versions(registry, work, cfg.versions)
        listing = timed(lambda: registry.versions())
        count = sum(len(v) for v in registry.versions().values())
        print(f"\nweights file of {cfg.size_mb} MB, bare repository on the local disk\n")
        print(f"{'figure':<36} {'seconds':>8}  {'vs cp':>7}  goal")
        print(f"{'cp of the file (peer)':<36} {cp:8.2f}")
        print(f"{'registry push (new version)':<36} {push:8.2f}  {push / cp:6.2f}x  <= 2x")
        print(f"{'registry pull (one version)':<36} {pull:8.2f}  {pull / cp:6.2f}x  <= 3x")
        print(f"{f'registry list ({count} versions)':<36} {listing:8.2f}  {'':>7}  < 1 s")


def _many_versions(registry: Registry, work: Path, n: int) -> None:
    """n more version branches of one small model, pushed in one go (as many pushes over months would leave)."""
    small = fake_run(work / "small", 1)
    registry.push(small.root, "small")
    repo = work / "many"
    subprocess.run(
        ["git", "clone", "-q", "--bare", registry.remote, str(repo)],
        check=True,
        env={**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"},
    )
    commit = subprocess.run(
        ["git", "rev-parse", "models/small/v1"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    updates = "".join(f"create refs/heads/models/small/v{v} {commit}\n" for v in range(2, n + 1))
    subprocess.run(["git", "update-ref", "--stdin"], cwd=repo, input=updates, text=True, check=True)
    subprocess.run(
        ["git", "push", "-q", registry.remote, "refs/heads/models/small/*:refs/heads/models/small/*"],
        cwd=repo,
        check=True,
    )


if __name__ == "__main__":
    main(tyro.cli(Config))
