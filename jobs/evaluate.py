#!/usr/bin/env python3
"""Evaluate a finished run (or its final/ weights) on a split of a clip store.

    python jobs/evaluate.py --run runs/videovit-b --store /lustre/scratch/k400 --split test

Prints clip- and video-level top-1/top-5 and writes ``eval-<split>.json`` into the run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from clipforge.hpc.logs import setup_logging
from clipforge.jobs import config
from clipforge.models.trainer import TrainError, evaluate_model, load_trained
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import StoreError


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
    try:
        model, record = load_trained(cfg.run)
        dataset = ClipDataset(cfg.store or Path(record["store"]), cfg.split)
    except (TrainError, StoreError) as exc:
        raise config.ConfigError(str(exc)) from None
    if dataset.classes != record["classes"]:
        raise config.ConfigError(f"the store's classes {dataset.classes} are not the run's {record['classes']}")
    metrics = evaluate_model(model, dataset, cfg.batch, record["crop"])
    out = (cfg.run if (cfg.run / "final").is_dir() else cfg.run.parent) / f"eval-{cfg.split}.json"
    out.write_text(json.dumps(metrics, indent=1))
    print(f"{cfg.split}: {metrics['clips']} clips of {metrics['videos']} videos; clip top-1 {metrics['clip_top1']:.3f} "
          f"top-5 {metrics['clip_top5']:.3f}; video top-1 {metrics['video_top1']:.3f} top-5 {metrics['video_top5']:.3f} ({out})")  # fmt: skip
    return metrics


if __name__ == "__main__":
    sys.exit(config.guarded(lambda: main(parse()))())
