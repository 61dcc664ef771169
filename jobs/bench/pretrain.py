#!/usr/bin/env python3
"""Benchmark of masked-autoencoder pretraining: its speed beside fine-tuning, and what it buys with few labels.

    python jobs/bench/pretrain.py [--repeats 3] [--fine-tune-seeds 3] [--pretrain-steps 300] [--fine-tune-steps 120]
                                  [--label-share 0.1] [--no-norm-pixels] [--masking random] [--textured]

Makes a motion corpus of six classes and packs it twice from one split: every
training video (the unlabelled pool pretraining reads, labels ignored) and a
``--label-share`` of them per class (the labels fine-tuning gets), with the same
validation videos. Each repeat pretrains the encoder on the pool with its own
seed; each pretraining is fine-tuned on the labelled share with every fine-tuning
seed, and the same model is trained from scratch once per fine-tuning seed, the
sides in alternating order; video top-1 is read on the validation videos. The
differences are paired by fine-tuning seed, so a pretraining's effect is told
apart from the luck of one fine-tuning. It prints:

- pretraining clips/s beside fine-tuning clips/s of the same encoder at the same
  batch (the encoder of a masked autoencoder sees 1 - mask ratio of the tokens);
- video top-1 of fine-tuning from each pretraining and of training from scratch,
  and their paired differences, per pretraining and over all pairs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

from clipforge.hpc.mpi import mpiexec_command
from clipforge.preprocess import synthetic
from clipforge.rundir import RunDir

MODEL = ["--model.name", "videovit-tiny", "--model.depth", "4", "--model.tubelet", "2", "8", "8"]
MODEL += ["--model.position", "sincos-1d", "--model.qkv-bias", "qv", "--model.head-norm", "pooled"]


@dataclasses.dataclass
class Config:
    """Pretraining throughput beside fine-tuning, and fine-tuning with few labels from it against from scratch."""

    repeats: int = 3
    """Pretrainings, seeds 0 ... repeats-1."""
    fine_tune_seeds: int = 3
    """Fine-tuning seeds 0 ... N-1: each pretraining is fine-tuned with each, and from scratch is trained with each."""
    pretrain_steps: int = 300
    """Pretraining steps (batch 8)."""
    fine_tune_steps: int = 120
    """Fine-tuning steps, and the from-scratch run's (batch 8)."""
    label_share: float = 0.1
    """The share of the training videos whose labels fine-tuning sees (at least one per class)."""
    videos_per_class: int = 30
    """Videos of each of the six motion classes."""
    textured: bool = False
    """A corpus of textured videos: a background of still waves and a checkered or striped shape, not flat colours."""
    masking: Literal["tube", "random"] = "tube"
    """Pretraining's masking (--mae.masking): the same spatial patches at every time, or tokens drawn alike."""
    norm_pixels: bool = True
    """Pretraining's loss on each tubelet's pixels normalised by its own mean and deviation (VideoMAE's);
    ``--no-norm-pixels``: on the pixels as they are."""


CLIPS = ["--clip-frames", "8", "--frame-stride", "2", "--height", "32", "--width", "32", "--clips-per-video", "4"]
"""How both stores are packed: 8x32x32 clips, four a video."""
FINE_TUNING = ["--model.drop-path", "0.1", "--optim.lr", "1e-3"]
"""Fine-tuning's settings, and training from scratch's."""


def pretraining(masking: str, norm_pixels: bool) -> list[str]:
    """Pretraining's settings."""
    pixels = "--mae.norm-pixels" if norm_pixels else "--mae.no-norm-pixels"
    return ["--objective", "mae", "--optim.lr", "1.5e-3", pixels, "--mae.masking", masking]


def make_videos(root: Path, videos_per_class: int, textured: bool) -> Path:
    """The benchmark's corpus (seed 3) under ``root``."""
    synthetic.make_corpus(root, videos_per_class=videos_per_class, frames=(48, 64), seed=3, textured=textured)
    return root


def train_argv(store: Path, run: Path, steps: int, seed: int, *extra: str) -> list[str]:
    """One training run of the benchmark (batch 8, evaluated once at its end), without the launcher."""
    argv = [sys.executable, "-m", "clipforge.jobs.train", "--data.store", str(store), "--run-dir", str(run)]
    argv += ["--steps", str(steps), "--batch-per-rank", "8", "--data.workers", "0"]
    return [*argv, "--eval-every", "100000", "--checkpoint-every", "100000", "--seed", str(seed), *extra]


def pack(manifest: Path, out: Path) -> Path:
    argv = [*mpiexec_command(2), sys.executable, "-m", "clipforge.jobs.preprocess", "--videos", str(manifest)]
    subprocess.run([*argv, "--out", str(out), *CLIPS], check=True, capture_output=True)
    return out


def train(store: Path, run: Path, steps: int, seed: int, *extra: str) -> dict:
    argv = [*mpiexec_command(1), *train_argv(store, run, steps, seed, *extra)]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{run.name} failed:\n{result.stderr[-3000:]}")
    summary = RunDir(run).metrics("summary")[-1]
    record = RunDir(run).record()
    return {"clips_per_s": summary["clips_per_s"], **record.metrics}


def manifests(videos: Path, work: Path, share: float) -> tuple[Path, Path]:
    """Two manifests over one split: every training video, and ``share`` of them per class; the same val videos."""
    rng = np.random.default_rng(0)
    pool, labelled = ["path,label,split"], ["path,label,split"]
    for folder in sorted(p for p in videos.iterdir() if p.is_dir()):
        files = sorted(folder.iterdir())
        order = rng.permutation(len(files))
        val = {files[i] for i in order[: len(files) * 3 // 10]}
        train = [f for f in files if f not in val]
        keep = set(train[: max(1, round(share * len(train)))])
        for f in files:
            split = "val" if f in val else "train"
            pool.append(f"{f},{folder.name},{split}")
            if f in val or f in keep:
                labelled.append(f"{f},{folder.name},{split}")
    (work / "pool.csv").write_text("\n".join(pool) + "\n")
    (work / "labelled.csv").write_text("\n".join(labelled) + "\n")
    return work / "pool.csv", work / "labelled.csv"


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-pretrain-") as tmp:
        work = Path(tmp)
        make_videos(work / "videos", cfg.videos_per_class, cfg.textured)
        pool_csv, labelled_csv = manifests(work / "videos", work, cfg.label_share)
        pool, labelled = pack(pool_csv, work / "pool"), pack(labelled_csv, work / "labelled")
        n_pool = sum(1 for line in pool_csv.read_text().splitlines() if line.endswith(",train"))
        n_labelled = sum(1 for line in labelled_csv.read_text().splitlines() if line.endswith(",train"))
        pretrained, tuned, scratch = {}, {}, {}
        for p in range(cfg.repeats):
            mae = work / f"mae-{p}"
            objective = pretraining(cfg.masking, cfg.norm_pixels)
            pretrained[p] = train(pool, mae, cfg.pretrain_steps, p, *MODEL, *objective)
            print(f"  pretraining {p}: {pretrained[p]['clips_per_s']:.1f} clips/s", file=sys.stderr, flush=True)
            for f in range(cfg.fine_tune_seeds):
                sides = {"fine-tuned": ["--model.weights", str(mae)]}
                if f not in scratch:
                    sides["from scratch"] = MODEL
                for side in list(sides) if (p + f) % 2 == 0 else list(reversed(sides)):
                    got = train(
                        labelled,
                        work / f"{side}-{p}-{f}".replace(" ", "-"),
                        cfg.fine_tune_steps,
                        f,
                        *sides[side],
                        *FINE_TUNING,
                    )
                    (tuned.setdefault(p, {}) if side == "fine-tuned" else scratch)[f] = got
                    print(
                        f"  pretraining {p}, seed {f}: {side} video top-1 {got['video_top1']:.3f}",
                        file=sys.stderr,
                        flush=True,
                    )

    ratio = [
        pretrained[p]["clips_per_s"] / statistics.median(r["clips_per_s"] for r in tuned[p].values())
        for p in pretrained
    ]
    print(
        f"\nvideovit-tiny depth 4, 8x32x32 clips in 2x8x8 tubelets (64 tokens), batch 8, 1 process; "
        f"{cfg.repeats} pretrainings of {cfg.pretrain_steps} steps ({'normalised' if cfg.norm_pixels else 'raw'} "
        f"pixels, {cfg.masking} masking), each fine-tuned with {cfg.fine_tune_seeds} seeds; fine-tuning and from "
        "scratch alternating"
        f"{'; textured videos' if cfg.textured else ''}\n"
    )
    print(f"{'run':<34} {'clips/s':>8} {'vs fine-tuning':>15} {'min-max':>11}")
    pre_s = [r["clips_per_s"] for r in pretrained.values()]
    fine_s = [r["clips_per_s"] for runs in tuned.values() for r in runs.values()]
    print(
        f"{'pretraining (mask 0.9, decoder 4)':<34} {statistics.median(pre_s):8.1f} "
        f"{statistics.median(ratio):14.2f}x {spread(ratio):>11}"
    )
    print(f"{'fine-tuning (all tokens)':<34} {statistics.median(fine_s):8.1f}")
    print(
        f"\nvideo top-1 on {cfg.videos_per_class * 6 * 3 // 10} validation videos, {cfg.fine_tune_steps} steps on "
        f"{n_labelled} labelled training videos ({n_labelled / n_pool:.0%} of the {n_pool} pretraining saw)\n"
    )
    seeds = range(cfg.fine_tune_seeds)
    print(f"{'':<16}" + "".join(f"{'seed ' + str(f):>9}" for f in seeds) + f"{'median diff':>13}{'above':>7}")
    print(f"{'from scratch':<16}" + "".join(f"{scratch[f]['video_top1']:9.3f}" for f in seeds))
    gain = []
    for p in pretrained:
        diffs = [tuned[p][f]["video_top1"] - scratch[f]["video_top1"] for f in seeds]
        gain += diffs
        print(
            f"{'pretraining ' + str(p):<16}"
            + "".join(f"{tuned[p][f]['video_top1']:9.3f}" for f in seeds)
            + f"{statistics.median(diffs):+13.3f}{sum(d > 0 for d in diffs):>5}/{len(diffs)}"
        )
    print(
        f"\nall {len(gain)} pairs: median difference {statistics.median(gain):+.3f} (min {min(gain):+.3f}, max "
        f"{max(gain):+.3f}); fine-tuned above from scratch in {sum(d > 0 for d in gain)}, below in "
        f"{sum(d < 0 for d in gain)}"
    )
    print("\ngoal: pretraining >= 3x the clips/s of fine-tuning on a GPU; fine-tuned above from scratch")
    print(json.dumps({"ratio": ratio, "gain": gain}), file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Config))
