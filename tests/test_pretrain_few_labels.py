"""With a tenth of the labels, fine-tuning from a masked-autoencoder pretraining beats training from scratch.

Checked last (marked checks_early): the runs are early work (few_labels.py), trained beside the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clipforge.rundir import RunDir

from .few_labels import FINE_TUNE_STEPS, PRETRAIN_STEPS, SEEDS

pytestmark = pytest.mark.checks_early


@pytest.fixture(scope="module")
def few_labels(early) -> dict[str, Path]:
    return early.result("few-labels")


def top1(run: Path) -> float:
    return float(json.loads((run / "eval.json").read_text())["video_top1"])


def test_with_a_tenth_of_the_labels_fine_tuning_from_pretraining_beats_training_from_scratch(few_labels) -> None:
    pretraining = RunDir(few_labels["pretrained"])
    losses = [r["loss"] for r in pretraining.metrics("train")]
    assert len(losses) >= 2 and losses[-1] < 0.8 * losses[0], losses  # it learned to fill in the masked tokens
    record = pretraining.record()
    assert record.steps == PRETRAIN_STEPS and record.pretraining["masking"] == "random" and record.encoder_only
    tuned = {seed: top1(few_labels[f"fine-tuned-{seed}"]) for seed in SEEDS}
    scratch = {seed: top1(few_labels[f"from-scratch-{seed}"]) for seed in SEEDS}
    videos = json.loads((few_labels["fine-tuned-0"] / "eval.json").read_text())["videos"]
    assert videos == 54 and RunDir(few_labels["fine-tuned-0"]).record().steps == FINE_TUNE_STEPS
    # Paired by seed (the same head initialisation, batches and augmentation), and on average over the seeds by at
    # least 2 of the 54 videos. Measured over 7 pretraining seeds with these settings (README): every pair above,
    # by 0.019-0.241; the mean over the two seeds 0.065-0.167 above.
    assert all(tuned[s] > scratch[s] for s in SEEDS), (tuned, scratch)
    assert sum(tuned.values()) / len(SEEDS) >= sum(scratch.values()) / len(SEEDS) + 0.04, (tuned, scratch)
