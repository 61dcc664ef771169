#!/usr/bin/env python3
"""Benchmark of the registry: push and pull of a large weights file against ``cp``, and ``list`` at 1,000 versions.

    python jobs/bench_registry.py [--size-mb 500] [--versions 1000]

Runs against a bare repository on the local disk (the shared-filesystem case).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import tyro
import yaml

from clipforge.registry.repo import Ref, Registry


@dataclasses.dataclass
class Config:
    """Measure registry push, pull and list."""

    size_mb: int = 500
    """Size of the weights file."""
    versions: int = 1000
    """Versions in the registry for the list figure."""


def fake_run(folder: Path, size_mb: int) -> Path:
    (folder / "final").mkdir(parents=True)
    with open(folder / "final" / "model.safetensors", "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    record = {
        "model": "videovit-base", "architecture": {}, "classes": ["a", "b"], "input": {"frames": 16, "height": 224, "width": 224},
        "crop": None, "metrics": {"clip_top1": 0.5, "clip_top5": 1.0, "video_top1": 0.5, "video_top5": 1.0, "loss": 1.0},
    }  # fmt: skip
    (folder / "final" / "run.json").write_text(json.dumps(record))
    (folder / "config.yaml").write_text(yaml.safe_dump({"steps": 1}))
    return folder


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-registry-") as tmp:
        work = Path(tmp)
        os.environ.update(HOME=str(work), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=str(work / ".gitconfig"))
        run = fake_run(work / "run", cfg.size_mb)
        weights = run / "final" / "model.safetensors"
        cp = timed(lambda: shutil.copyfile(weights, work / "copy.bin"))
        registry = Registry.init(str(work / "remote.git"))
        push = timed(lambda: registry.push(run, "big"))
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
    registry.push(small, "small")
    repo = work / "many"
    subprocess.run(["git", "clone", "-q", "--bare", registry.remote, str(repo)], check=True, env={**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"})
    commit = subprocess.run(["git", "rev-parse", "models/small/v1"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    updates = "".join(f"create refs/heads/models/small/v{v} {commit}\n" for v in range(2, n + 1))
    subprocess.run(["git", "update-ref", "--stdin"], cwd=repo, input=updates, text=True, check=True)
    subprocess.run(["git", "push", "-q", registry.remote, "refs/heads/models/small/*:refs/heads/models/small/*"], cwd=repo, check=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
