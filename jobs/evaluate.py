#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-evaluate
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=60
#SBATCH --signal=USR2@120
# fmt: on
"""Evaluate a finished run (or its final/ weights) on a split of a clip store, over ranks, with multi-view testing.

    python jobs/evaluate.py --run runs/videovit-b --store /lustre/scratch/k400 --split test
    python jobs/evaluate.py --run runs/videovit-b --views.temporal 5 --views.spatial 3 \\
        --views.source videos --nodes 2 --ntasks-per-node 4 --gpus-per-node 4
    sbatch jobs/evaluate.py --run runs/videovit-b

Every rank scores every world-size-th video; rank 0 gathers a softmax row per
video, prints clip(view)- and video-level top-1/top-5 and writes
``eval-<split>.json`` into the run.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # sbatch runs the first python3 on PATH: say so in one line if it lacks clipforge
    try:
        import clipforge.hpc.launch  # noqa: F401
    except ImportError as missing:
        sys.exit(
            f"clipforge: error: {sys.executable} cannot run this job ({missing}); activate the environment clipforge "
            "is installed in (source <venv>/bin/activate) before python or sbatch, which passes it on to the job"
        )

import dataclasses
import logging
import time
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from clipforge.base.logs import Progress, setup_logging
from clipforge.hpc.distenv import init_process_group, setup_distributed, task_device
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.resources import Resources
from clipforge.inference.evaluation import evaluate_videos_on_ranks, inference
from clipforge.inference.views import Views
from clipforge.jobs import config
from clipforge.models.builders import classifier_run, load_trained
from clipforge.preprocess.reader import DecodedVideos, StoredVideos
from clipforge.preprocess.store import ClipStore
from clipforge.rundir import RunDir, RunRecord

log = logging.getLogger("clipforge.evaluate")


@dataclasses.dataclass
class Config:
    """Evaluate a trained model on a clip store split."""

    run: Path = Path("runs/train")
    """A finished run directory (or its final/ folder)."""
    store: Path | None = None
    """Clip store to evaluate on; default: the one the run trained on."""
    split: str = "test"
    """Split of the store."""
    views: Views = dataclasses.field(default_factory=Views)
    views_per_pass: int = 16
    """Views per forward pass."""
    workers: int = 1
    """Processes per rank reading (or decoding) the next videos while the model runs."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on a GPU, fp32 on CPUs."""
    videos_root: Path | None = None
    """Folder of the source videos for --views.source videos; default: the one the store was packed from."""
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(cpus_per_task=2, time="01:00:00", job_name="clipforge-evaluate")
    )


def parse(argv: list[str] | None = None) -> Config:
    return config.parse(Config, argv)


def prepared(cfg: Config) -> tuple[RunDir, RunRecord, ClipStore, Views]:
    """The run, its record, the store and the views, each checked: one line for what is wrong."""
    run, record = classifier_run(cfg.run)
    store = ClipStore.open(cfg.store or Path(record.store))
    if store.classes != record.classes:
        raise config.ConfigError(f"the store's classes {store.classes} are not the run's {record.classes}")
    StoredVideos(store, cfg.split)  # the split exists
    if cfg.views_per_pass < 1 or cfg.workers < 0:
        raise config.ConfigError(
            f"views_per_pass must be at least 1 and workers 0 or more, got {cfg.views_per_pass} and {cfg.workers}"
        )
    views = cfg.views.check(record.crop, store.params["height"], store.params["width"])
    if views.source == "store" and cfg.videos_root is not None:
        raise config.ConfigError(
            f"--videos-root {cfg.videos_root} is read only with --views.source videos (the clips come from the "
            "store otherwise); drop it or add --views.source videos"
        )
    return run, record, store, views


def check(cfg: Config) -> None:
    prepared(cfg)


def main(cfg: Config) -> dict | None:
    env = setup_distributed()
    setup_logging(env.rank if env.world_size > 1 else None)
    run, record, store, views = prepared(cfg)
    device = task_device(env)
    init_process_group(env, device)
    model, _ = load_trained(run.root)
    if views.source == "store":
        videos = StoredVideos(store, cfg.split, views.temporal)
    else:
        videos = DecodedVideos.of_split(store, cfg.split, views.temporal, cfg.videos_root)
    mine = len(range(env.rank, len(videos), env.world_size))
    progress = Progress(mine, f"evaluating {cfg.split} ({views.label})", unit="video", enabled=env.is_main)
    forward = inference(model, device, cfg.precision)
    started = time.perf_counter()  # after start-up: the process, the model and its weights are ready
    metrics = evaluate_videos_on_ranks(
        forward, videos, record.classes, record.crop, views, cfg.views_per_pass, device, cfg.workers, progress.update
    )
    seconds = time.perf_counter() - started
    progress.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if metrics is None:
        return None
    for failure in metrics["failures"]:
        log.warning("skipped %s", failure)
    metrics.update(seconds=seconds, videos_per_s=metrics["videos"] / seconds, clips_per_s=metrics["clips"] / seconds)
    out = run.write_evaluation(cfg.split, metrics)
    m = metrics
    print(
        f"{cfg.split}: {m['videos']} videos, {m['clips']} views ({m['views']}); "
        f"clip top-1 {m['clip_top1']:.3f} top-5 {m['clip_top5']:.3f}; "
        f"video top-1 {m['video_top1']:.3f} top-5 {m['video_top5']:.3f}; "
        f"{m['videos_per_s']:.1f} videos/s, {m['clips_per_s']:.1f} views/s after start-up ({out})"
    )
    return metrics


SPEC = JobSpec("clipforge.jobs.evaluate", parse, main, check=check)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
