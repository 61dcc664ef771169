#!/usr/bin/env python3
"""Evaluate a finished run (or its final/ weights) on a split of a clip store.

    python jobs/evaluate.py --run runs/videovit-b --store /lustre/scratch/k400 --split test

Prints clip- and video-level top-1/top-5 and writes ``eval-<split>.json`` into the run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from clipforge.hpc.logs import setup_logging
from clipforge.jobs import config
from clipforge.models.builders import load_trained
from clipforge.models.evaluation import evaluate_model
from clipforge.preprocess.reader import ClipDataset
from clipforge.rundir import RunDir


@dataclasses.dataclass
class Config:
    """Evaluate a trained model on a clip store split."""

    run: Path = Path("runs/train")
    """A finished run directory (or its final/ folder)."""
    store: Path | None = None
    """Clip store to evaluate on; default: the one the run trained on."""
    split: str = "test"
    """Split of the store."""
    batch: int = 16
    """Clips per forward pass."""


def parse(argv: list[str] | None = None) -> Config:
    return config.parse(Config, argv)


def main(cfg: Config) -> dict:
    setup_logging()
    run = RunDir.find(cfg.run)
    model, record = load_trained(run.root)
    dataset = ClipDataset(cfg.store or Path(record.store), cfg.split)
    if dataset.classes != record.classes:
        raise config.ConfigError(f"the store's classes {dataset.classes} are not the run's {record.classes}")
    metrics = evaluate_model(model, dataset, cfg.batch, record.crop)
    out = run.write_evaluation(cfg.split, metrics)
    m = metrics
    print(
        f"{cfg.split}: {m['clips']} clips of {m['videos']} videos; clip top-1 {m['clip_top1']:.3f} top-5 "
        f"{m['clip_top5']:.3f}; "
        f"video top-1 {m['video_top1']:.3f} top-5 {m['video_top5']:.3f} ({out})"
    )
    return metrics


if __name__ == "__main__":
    sys.exit(config.guarded(lambda: main(parse()))())
