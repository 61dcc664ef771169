#!/usr/bin/env python3
"""Benchmark of the registry: push and pull of a large weights file against their floor, and ``list``.

    python jobs/bench/registry.py [--size-mb 500] [--repeats 5] [--versions 1000]

Runs against a bare repository on the local disk (the shared-filesystem case).
The floor of a push or a pull is one sha256 pass over the file (hashlib:
OpenSSL's SHA-256) plus one copy of it, measured in the same run; the peer is
plain git with git-lfs by hand doing the same push (``git add``, ``commit``,
``push``) and pull (``clone --no-checkout``, ``lfs fetch``, ``checkout``).
Each round runs all sides in turn; figures are medians over the rounds, ratios
the median of the paired ratios with their min-max.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import tyro

from clipforge.base.files import sha256
from clipforge.registry.repo import Registry
from clipforge.rundir import HEADLINE_METRICS, InputShape, RunDir, RunRecord


@dataclasses.dataclass
class Config:
    """Measure registry push, pull and list."""

    size_mb: int = 500
    """Size of the weights file."""
    repeats: int = 5
    """Alternating rounds of every side."""
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


def timed(fn, *args) -> tuple[float, object]:
    os.sync()  # the previous side's writes flushed first: each side pays for its own
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def renew(weights: Path, n: int) -> None:
    """Change the last tensor bytes of the weights (the file stays valid safetensors), so its sha256 is new."""
    with open(weights, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(n.to_bytes(8, "little"))


def floor(weights: Path, to: Path) -> None:
    """One sha256 pass and one copy: what any verified transfer of the file must at least do."""
    sha256(weights, copy_to=to)


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=cwd, check=True, capture_output=True
    )


def plain_push(weights: Path, remote: Path, work: Path, n: int) -> None:
    """What a user does by hand: copy the file into a clone, git add (git-lfs hashes and stores it), commit, push."""
    clone = work / f"plain-{n}"
    git(work, "clone", "-q", str(remote), str(clone))
    git(clone, "lfs", "install", "--local")
    assert (clone / ".gitattributes").exists(), "the clone did not check out main: git add would skip git-lfs"
    shutil.copyfile(weights, clone / "model.safetensors")
    git(clone, "add", "model.safetensors")
    git(clone, "commit", "-qm", "weights")
    git(clone, "push", "-q", "origin", f"HEAD:refs/heads/plain/{n}")
    shutil.rmtree(clone)


def plain_pull(remote: Path, work: Path, n: int) -> None:
    clone = work / f"pulled-plain-{n}"
    env = {**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"}
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(remote), str(clone)], check=True, env=env)
    git(clone, "lfs", "install", "--local")
    git(clone, "lfs", "fetch", "origin", f"origin/plain/{n}")
    git(clone, "checkout", "-q", f"origin/plain/{n}")
    shutil.rmtree(clone)


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-registry-") as tmp:
        work = Path(tmp)
        os.environ.update(HOME=str(work), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=str(work / ".gitconfig"))
        run = fake_run(work / "run", cfg.size_mb)
        weights = run.weights
        registry = Registry.init(str(work / "remote.git"))
        plain = work / "plain.git"
        subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(plain)], check=True)
        seed = work / "seed"
        git(work, "clone", "-q", str(plain), str(seed))
        (seed / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
        git(seed, "add", ".gitattributes")
        git(seed, "commit", "-qm", "lfs")
        git(seed, "push", "-q", "origin", "HEAD:main")
        rounds: dict[str, list[float]] = {k: [] for k in ("floor", "plain push", "push", "plain pull", "pull")}
        steps: dict[str, list[float]] = {}
        for n in range(cfg.repeats):
            seconds = {}
            seconds["floor"], _ = timed(floor, weights, work / "copy.bin")
            (work / "copy.bin").unlink()
            renew(weights, 2 * n)  # every push is of new weights, as a new version's are
            seconds["plain push"], _ = timed(plain_push, weights, plain, work, n)
            renew(weights, 2 * n + 1)
            spent: dict[str, float] = {}

            def on_step(step: str, took: float, spent: dict[str, float] = spent) -> None:
                spent[step] = spent.get(step, 0.0) + took  # a push that lost a race repeats its steps

            seconds["push"], ref = timed(registry.push, run.root, "big", 50, on_step)
            for step, took in spent.items():
                steps.setdefault(step, []).append(took)
            seconds["plain pull"], _ = timed(plain_pull, plain, work, n)
            seconds["pull"], _ = timed(registry.pull, ref, work / f"pulled-{n}")
            shutil.rmtree(work / f"pulled-{n}")
            for key, value in seconds.items():
                rounds[key].append(value)
            print(
                f"round {n + 1}/{cfg.repeats}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True
            )
        _many_versions(registry, work, cfg.versions)
        listing, _ = timed(registry.versions)
        count = sum(len(v) for v in registry.versions().values())

        def ratio(a: str, b: str) -> str:
            paired = [x / y for x, y in zip(rounds[a], rounds[b])]
            return f"{statistics.median(paired):6.2f}x {min(paired):5.2f}-{max(paired):.2f}x"

        print(
            f"\nweights file of {cfg.size_mb} MB, bare repository on the local disk; medians of {cfg.repeats} rounds\n"
        )
        print(f"{'figure':<40} {'seconds':>8}  {'vs floor':>20}  {'vs plain git':>20}  goal")
        rows = (
            ("floor: one sha256 pass + one copy", "floor", None, None, ""),
            ("plain git + git-lfs push (peer)", "plain push", "floor", None, ""),
            ("registry push (new version)", "push", "floor", "plain push", "<= 2x floor"),
            ("plain git + git-lfs pull (peer)", "plain pull", "floor", None, ""),
            ("registry pull (one version)", "pull", "floor", "plain pull", "<= 1.5x floor"),
        )
        for name, key, base, peer, goal in rows:
            a = ratio(key, base) if base else ""
            b = ratio(key, peer) if peer else ""
            print(f"{name:<40} {statistics.median(rounds[key]):8.2f}  {a:>20}  {b:>20}  {goal}")
        print(f"{f'registry list ({count} versions)':<40} {listing:8.2f}  {'':>20}  {'':>20}  < 1 s")
        print("\nwhere a registry push's time goes (medians; the floor's work is the sha256 and copy step)\n")
        floor_s = statistics.median(rounds["floor"])
        for step, spent in steps.items():
            print(f"  {step:<58} {statistics.median(spent):6.2f} s  {statistics.median(spent) / floor_s:5.2f}x floor")
        fixed = statistics.median([p - s for p, s in zip(rounds["push"], steps["sha256 and copy into the LFS store"])])
        print(
            f"  {'everything but the sha256 and copy':<58} {fixed:6.2f} s  {fixed / floor_s:5.2f}x floor: the git "
            "processes of a versioned push"
        )


def _many_versions(registry: Registry, work: Path, n: int) -> None:
    """n more version branches of one small model, written into the bare repository as many pushes over months
    would leave them (by its administrator: the hooks refuse versions that did not come through registry push)."""
    small = fake_run(work / "small", 1)
    registry.push(small.root, "small")
    repo = Path(registry.remote)
    commit = subprocess.run(
        ["git", "rev-parse", "models/small/v1"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    updates = "".join(f"create refs/heads/models/small/v{v} {commit}\n" for v in range(2, n + 1))
    subprocess.run(["git", "update-ref", "--stdin"], cwd=repo, input=updates, text=True, check=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
