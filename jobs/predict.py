#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-predict
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=240
#SBATCH --signal=USR2@120
# fmt: on
"""Classify raw video files with a trained model, over ranks; a manifest of millions resumes where it stopped.

    python jobs/predict.py video1.mp4 video2.mkv --run runs/videovit-b --top 3
    python jobs/predict.py --manifest videos.txt --out predictions.jsonl --run runs/videovit-b \\
        --views.temporal 5 --views.spatial 3 --nodes 4 --ntasks-per-node 4 --gpus-per-node 4
    sbatch jobs/predict.py --manifest videos.txt --out predictions.jsonl --run runs/videovit-b

Each video is decoded with the clip parameters recorded in the store the model
trained on (``--views.temporal`` clips spread over it, ``--views.spatial``
crops of each); the softmax of its views is averaged. With ``--out`` every
video gets one JSON line, and a rerun skips the videos already written. A
video that cannot be decoded gets one line saying why, and the others are
still classified; the job then exits non-zero, naming how many failed.
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
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from clipforge.base.logs import Progress, setup_logging
from clipforge.hpc.distenv import init_process_group, setup_distributed, task_device, wait_for_ranks
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.resources import Resources
from clipforge.inference.evaluation import inference, one_video, view_logits
from clipforge.inference.prediction import PredictionError, PredictionLog, read_manifest, top_classes
from clipforge.inference.views import Views
from clipforge.jobs import config
from clipforge.models.builders import classifier_run, load_trained
from clipforge.preprocess.decode import ClipParams
from clipforge.preprocess.reader import DecodedVideos

log = logging.getLogger("clipforge.predict")


@dataclasses.dataclass
class Config:
    """Classify video files."""

    videos: tuple[Path, ...] = ()
    """Video files to classify."""
    manifest: Path | None = None
    """Also classify the videos listed in this file, one path per line (# starts a comment)."""
    run: Path = Path("runs/train")
    """A finished run directory (or its final/ folder)."""
    top: int = 5
    """How many classes to keep per video."""
    out: Path | None = None
    """Write one JSON line per video here; a rerun skips the videos it already holds."""
    views: Views = dataclasses.field(default_factory=lambda: Views(source="videos"))
    """The views of each video, decoded from the file (prediction has no store to take them from)."""
    views_per_pass: int = 16
    """Views per forward pass."""
    workers: int = 1
    """Processes per rank decoding the next videos while the model runs."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on a GPU, fp32 on CPUs."""
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(cpus_per_task=2, time="04:00:00", job_name="clipforge-predict")
    )


def parse(argv: list[str] | None = None) -> Config:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Positional video paths, as people type them: everything before the first option.
    positional = []
    while argv and not argv[0].startswith("-"):
        positional.append(argv.pop(0))
    cfg = config.parse(Config, argv)
    return dataclasses.replace(cfg, videos=tuple(Path(p) for p in positional) + cfg.videos)


def checked(cfg: Config) -> tuple[ClipParams, list[Path]]:
    """The clip parameters of the run's store and the videos to classify, each checked (one line for a problem)."""
    _, record = classifier_run(cfg.run)
    params = ClipParams.recorded(record.data_fingerprint["params"])
    cfg.views.check(record.crop, params.height, params.width)
    if cfg.views.source != "videos":
        raise config.ConfigError(
            f"--views.source {cfg.views.source}: prediction decodes the videos it is given, which are in no store; "
            "leave it out"
        )
    if not cfg.videos and cfg.manifest is None:
        raise config.ConfigError("no videos to classify: name video files, or a --manifest listing them")
    if cfg.top < 1 or cfg.views_per_pass < 1 or cfg.workers < 0:
        raise config.ConfigError("top and views_per_pass must be at least 1, workers 0 or more")
    return params, list(cfg.videos) + (read_manifest(cfg.manifest) if cfg.manifest is not None else [])


def check(cfg: Config) -> None:
    checked(cfg)


def main(cfg: Config) -> list[dict] | None:
    env = setup_distributed()
    setup_logging(env.rank if env.world_size > 1 else None)
    params, videos = checked(cfg)  # a rank of srun or submitit was not checked before it started
    device = task_device(env)
    grouped = init_process_group(env, device)
    model, record = load_trained(cfg.run)
    output = PredictionLog(cfg.out, env.rank) if cfg.out is not None else None
    done = output.done() if output is not None else set()
    if grouped:
        torch.distributed.barrier()  # every rank has read what is done before any writes more
    todo = [v for v in videos if str(v) not in done]
    if env.is_main and done:
        log.info(
            "%d of %d videos already predicted in %s; %d to go",
            len(videos) - len(todo),
            len(videos),
            cfg.out,
            len(todo),
        )
    mine = todo[env.rank :: env.world_size]
    loader = torch.utils.data.DataLoader(
        DecodedVideos(mine, params, cfg.views.temporal),
        batch_size=None,
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
        collate_fn=one_video,
    )
    forward = inference(model, device, cfg.precision)
    progress = Progress(len(mine), "predicting", unit="video", enabled=env.is_main and cfg.out is not None)
    results, failed = [], 0
    for path, item in zip(mine, loader):
        if item["error"] is not None:
            failed += 1
            print(f"{path}: cannot classify: {item['error'].removeprefix(f'{path}: ')}", file=sys.stderr)
            record_line = {"video": str(path), "error": item["error"]}
        else:
            logits = view_logits(forward, item["clips"], record.crop, cfg.views, cfg.views_per_pass, device)
            top = top_classes(logits, record.classes, cfg.top)
            record_line = {"video": str(path), "top": top, "views": len(logits)}
            if output is None:
                results.append(record_line)
                print(f"{path}: " + ", ".join(f"{t['class']} {t['probability']:.3f}" for t in top))
        if output is not None:
            output.append(record_line)
        progress.update(1)
    progress.close()
    log.info("%d videos classified on this rank", len(mine))
    if output is not None:
        output.close()
    if grouped:  # ranks end their shares apart by more than a collective's timeout on a large manifest
        wait_for_ranks("predicted")
    if output is not None:
        if env.is_main:
            added = output.merge()
            log.info("%d videos predicted now, %d lines in %s", added, len(output.done()), cfg.out)
            failed = len(output.failed() & {str(v) for v in videos})  # earlier runs' failures count too
    elif grouped:
        total = torch.tensor([failed], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(total)
        failed = int(total.item())
    if grouped:
        torch.distributed.destroy_process_group()
    if failed and env.is_main:
        # Only rank 0 fails the job: a rank that exits early would make srun kill it before it says why.
        where = f"their lines in {cfg.out} say why" if cfg.out is not None else "the lines above say why"
        raise PredictionError(
            f"{failed} of {len(videos)} videos could not be classified ({where}); the others were classified"
        )
    return results


SPEC = JobSpec("clipforge.jobs.predict", parse, main, check=check)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
