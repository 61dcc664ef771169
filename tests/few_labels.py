"""Pretraining on unlabelled clips, then fine-tuning on a tenth of their labels, against training from scratch on
the same tenth: the early work test_pretrain_few_labels.py checks, as jobs/bench/pretrain.py runs it (its corpus, split,
model and settings), at one pretraining and two fine-tuning seeds a side."""

from __future__ import annotations

import tempfile
from pathlib import Path

from clipforge.hpc.distenv import free_port
from clipforge.jobs.bench.pretrain import CLIPS, FINE_TUNING, MODEL, make_videos, manifests, pretraining, train_argv

from .early import Early
from .helpers import pack_argv

PRETRAIN_STEPS = 1500
"""Pretraining steps of 8 clips: 24 epochs of the 504 unlabelled clips (at 1000, one pretraining in four measured
was level with from scratch on one seed of two)."""
FINE_TUNE_STEPS = 120
"""Fine-tuning steps of 8 clips, and the from-scratch runs': 20 epochs of the 48 labelled clips."""
SEEDS = (0, 1)
"""Fine-tuning seeds: each fine-tunes the pretraining and trains from scratch once."""


def few_labels(early: Early, mpiexec: list[str]) -> dict[str, Path]:
    """The pretraining and every fine-tuning and from-scratch run, one after another: name -> run directory.

    The corpus is the benchmark's textured one (30 videos of each of the six motions, a still background of colour
    waves, a checkered square or striped bar that moves), 30% of each class held out; the pool is every training
    video (126), the labelled share a tenth of them per class (12). Its pretraining masks tokens at random (90%).
    """
    root = early.root / "few-labels"
    pool, labelled = manifests(make_videos(root / "videos", 30, textured=True), root, 0.1)
    for manifest in (pool, labelled):
        process = early.process(
            f"few-labels-pack-{manifest.stem}", pack_argv(mpiexec, 2, manifest, root / manifest.stem, *CLIPS)
        )
        assert process.wait(timeout=600) == 0, (early.root / f"few-labels-pack-{manifest.stem}.log").read_text()[-3000:]
    env, runs = early.own_extensions(), {}

    def run(name: str, store: str, steps: int, seed: int, *extra: str) -> None:
        runs[name] = root / name
        launch = [*mpiexec, "-n", "1", "-x", f"MASTER_PORT={free_port()}"]
        argv = [*launch, *train_argv(root / store, runs[name], steps, seed, *extra)]
        process = early.process(f"few-labels-{name}", argv, dict(env, TMPDIR=tempfile.mkdtemp(prefix="cf-mpi-")))
        assert process.wait(timeout=1800) == 0, (early.root / f"few-labels-{name}.log").read_text()[-4000:]

    run("pretrained", "pool", PRETRAIN_STEPS, 0, *MODEL, *pretraining("random", norm_pixels=False))
    for seed in SEEDS:
        run(
            f"fine-tuned-{seed}",
            "labelled",
            FINE_TUNE_STEPS,
            seed,
            "--model.weights",
            str(runs["pretrained"]),
            *FINE_TUNING,
        )
        run(f"from-scratch-{seed}", "labelled", FINE_TUNE_STEPS, seed, *MODEL, *FINE_TUNING)
    return runs
