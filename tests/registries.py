"""What the registry tests share: a finished run directory to push, and the objects a remote holds.

The fixtures they share (``isolated_git``, ``registry``) are in conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clipforge.registry.repo import Registry
from clipforge.rundir import HEADLINE_METRICS, InputShape, RunDir, RunRecord


def make_run(
    folder: Path,
    seed: int,
    top1: float = 0.5,
    lr: float = 1e-3,
    nudge: str | None = None,
    store_sha: str = "ab" * 32,
    federated: dict | None = None,
) -> Path:
    """A finished run directory, written by the run directory's own writer as jobs/train.py leaves it.

    ``nudge``: a tensor to change by 1% (the rest as ``seed`` makes them); ``store_sha``: the data it saw.
    """
    g = torch.Generator().manual_seed(seed)
    state = {"0.weight": torch.randn(64, 256, generator=g), "1.bias": torch.randn(64, generator=g)}
    if nudge is not None:
        state[nudge] = state[nudge] * 1.01
    classes = ["a", "b", "c"]
    metrics = {"clip_top1": top1, "clip_top5": 1.0, "video_top1": top1 + 0.1, "video_top5": 1.0, "loss": 1.0 - top1}
    metrics.update(split="val", per_class_accuracy={"a": 1.0, "b": 0.5, "c": None})
    params = {"clip_frames": 8, "height": 32, "width": 32}
    record = RunRecord(
        model="videovit-tiny",
        architecture={"depth": 2},
        classes=classes,
        input=InputShape(8, 32, 32),
        crop=None,
        store="store",
        data_fingerprint={"format_version": 1, "index_sha256": store_sha, "classes": classes, "params": params},
        metrics={k: metrics[k] for k in HEADLINE_METRICS},
        metrics_split="val",
        per_class_accuracy=metrics["per_class_accuracy"],
        steps=100,
        world_size=2,
        code_commit="0123abc",
        slurm_job_id="4242",
        federated=federated,
    )
    run = RunDir(folder)
    run.write_config({"steps": 100, "optim": {"lr": lr}})
    run.write_final(state, record, metrics)
    return folder


def stored_objects(registry: Registry) -> list[Path]:
    """The LFS objects the remote holds, whichever kind it is."""
    return [p for p in registry.objects.rglob("*") if p.is_file()]
