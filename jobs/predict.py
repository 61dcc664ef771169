#!/usr/bin/env python3
"""Classify raw video files with a trained model.

    python jobs/predict.py --run runs/videovit-b video1.mp4 video2.mkv --top 3

Each video is decoded with the clip parameters recorded in the store the model
trained on; the softmax of its clips is averaged. A video that cannot be
decoded gets one line saying why, and the others are still classified.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

from clipforge.hpc.files import write_json
from clipforge.hpc.logs import setup_logging
from clipforge.jobs import config
from clipforge.models.builders import load_trained
from clipforge.models.clips import center_crop
from clipforge.models.evaluation import softmax
from clipforge.preprocess.decode import ClipParams, VideoError, decode_clips
from clipforge.rundir import RunRecord


@dataclasses.dataclass
class Config:
    """Classify video files."""

    videos: tuple[Path, ...] = ()
    """Video files to classify."""
    run: Path = Path("runs/train")
    """A finished run directory (or its final/ folder)."""
    top: int = 5
    """How many classes to print per video."""
    json_out: Path | None = None
    """Also write the predictions to this JSON file."""


def parse(argv: list[str] | None = None) -> Config:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Positional video paths, as people type them: everything before the first option.
    positional = []
    while argv and not argv[0].startswith("-"):
        positional.append(argv.pop(0))
    cfg = config.parse(Config, argv)
    return dataclasses.replace(cfg, videos=tuple(Path(p) for p in positional) + cfg.videos)


@torch.no_grad()
def main(cfg: Config) -> list[dict]:
    setup_logging()
    model, record = load_trained(cfg.run)
    params = record_clip_params(record)
    results = []
    for path in cfg.videos:
        try:
            clips = decode_clips(path, params).clips
        except (VideoError, OSError) as exc:
            print(f"{path}: cannot classify: {exc}", file=sys.stderr)
            continue
        batch = center_crop(torch.from_numpy(np.ascontiguousarray(clips)), record.crop)
        probs = softmax(model(batch).float().numpy()).mean(axis=0)
        best = np.argsort(-probs)[: cfg.top]
        top = [{"class": record.classes[i], "probability": float(probs[i])} for i in best]
        results.append({"video": str(path), "top": top})
        print(f"{path}: " + ", ".join(f"{t['class']} {t['probability']:.3f}" for t in top))
    if cfg.json_out is not None:
        write_json(cfg.json_out, results)
    return results


def record_clip_params(record: RunRecord) -> ClipParams:
    """The clip parameters of the store the model trained on (recorded in its data fingerprint)."""
    fields = {f.name for f in dataclasses.fields(ClipParams)}
    return ClipParams(**{k: v for k, v in record.data_fingerprint["params"].items() if k in fields})


if __name__ == "__main__":
    sys.exit(config.guarded(lambda: main(parse()))())
