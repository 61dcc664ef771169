#!/usr/bin/env python3
"""Classify raw video files with a trained model.

    python jobs/predict.py --run runs/videovit-b video1.mp4 video2.mkv --top 3

Each video is decoded with the clip parameters recorded in the store the model
trained on; the softmax of its clips is averaged. A video that cannot be
decoded gets one line saying why, and the others are still classified.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from clipforge.hpc.logs import setup_logging
from clipforge.jobs import config
from clipforge.models.evaluation import softmax
from clipforge.models.trainer import TrainError, load_trained
from clipforge.preprocess.decode import ClipParams, VideoError, decode_clips


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
    try:
        model, record = load_trained(cfg.run)
    except TrainError as exc:
        raise config.ConfigError(str(exc)) from None
    params = record_clip_params(record)
    results = []
    for path in cfg.videos:
        try:
            clips = decode_clips(path, params).clips
        except (VideoError, OSError) as exc:
            print(f"{path}: cannot classify: {exc}", file=sys.stderr)
            continue
        if record["crop"]:
            c, (h, w) = record["crop"], clips.shape[2:4]
            clips = clips[:, :, (h - c) // 2 : (h - c) // 2 + c, (w - c) // 2 : (w - c) // 2 + c]
        probs = softmax(model(torch.from_numpy(np.ascontiguousarray(clips))).float().numpy()).mean(axis=0)
        best = np.argsort(-probs)[: cfg.top]
        top = [{"class": record["classes"][i], "probability": float(probs[i])} for i in best]
        results.append({"video": str(path), "top": top})
        print(f"{path}: " + ", ".join(f"{t['class']} {t['probability']:.3f}" for t in top))
    if cfg.json_out is not None:
        cfg.json_out.write_text(json.dumps(results, indent=1))
    return results


def record_clip_params(record: dict) -> ClipParams:
    """The clip parameters of the store the model trained on (recorded in its data fingerprint)."""
    fields = {f.name for f in dataclasses.fields(ClipParams)}
    return ClipParams(**{k: v for k, v in record["data_fingerprint"]["params"].items() if k in fields})


if __name__ == "__main__":
    sys.exit(config.guarded(lambda: main(parse()))())
