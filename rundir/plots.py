"""The plots a person reads in a run directory: loss and accuracy curves, and the confusion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def plot_run(
    rows: list[dict[str, Any]], classes: list[str], out: Path, confusion: list[list[int]] | None = None
) -> list[Path]:
    """Loss and accuracy curves from a run's metrics rows, and the final evaluation's ``confusion`` matrix, as PNG
    files in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train" and "loss" in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    scored = [r for r in evals if "clip_top1" in r]  # pretraining evaluates its loss alone
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label=f"{evals[-1]['split']} loss")
    if scored:
        ax2.plot([r["step"] for r in scored], [r["clip_top1"] for r in scored], "o-", label="clip top-1")
        ax2.plot([r["step"] for r in scored], [r["video_top1"] for r in scored], "s-", label="video top-1")
        ax2.set_ylim(0, 1)
        ax2.legend()
    ax1.set_xlabel("step"), ax1.set_ylabel("loss")
    ax2.set_xlabel("step"), ax2.set_ylabel("accuracy")
    if train or evals:
        ax1.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)
    paths.append(out / "curves.png")
    if scored and confusion is not None:
        paths.append(plot_confusion(np.array(confusion), classes, scored[-1], out / "confusion.png"))
    return paths


LABELLED_CLASSES = 30
"""Up to this many classes the confusion matrix names each class and prints each cell's count."""


def plot_confusion(confusion: np.ndarray, classes: list[str], row: dict[str, Any], path: Path) -> Path:
    """The confusion matrix as an image: named and counted cell by cell for a few classes; for more (Kinetics' 400),
    a fixed-size heat map with every tenth class numbered. Sized by the class count with a label in every cell, the
    plot took 24.5 s and 2.4 GiB at 140 classes, growing with the square of the count (a 400-class figure: 24000 px
    square, 160000 labels), at the end of every run."""
    import matplotlib.pyplot as plt

    n = len(classes)
    side = 1 + 0.6 * n if n <= LABELLED_CLASSES else 10
    fig, ax = plt.subplots(figsize=(side + 0.2, side))
    image = ax.imshow(confusion, cmap="Blues", interpolation="nearest")
    if n <= LABELLED_CLASSES:
        ax.set_xticks(range(n), classes, rotation=45, ha="right")
        ax.set_yticks(range(n), classes)
        for i in range(n):
            for j in range(n):
                ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8)
    else:  # the class names by index are in the run's record and eval.json
        ticks = range(0, n, max(1, n // 10))
        ax.set_xticks(ticks), ax.set_yticks(ticks)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="videos")
    ax.set_xlabel("predicted class"), ax.set_ylabel("true class")
    ax.set_title(f"{row['split']} videos, step {row['step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
