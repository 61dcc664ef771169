"""The plots a person reads in a run directory: loss and accuracy curves, and the confusion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def plot_run(rows: list[dict[str, Any]], classes: list[str], out: Path) -> list[Path]:
    """Loss and accuracy curves from a run's metrics rows and the last confusion matrix, as PNG files in ``out``."""
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
    if scored:
        confusion = np.array(scored[-1]["confusion"])
        fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(classes), 1 + 0.6 * len(classes)))
        ax.imshow(confusion, cmap="Blues")
        ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
        ax.set_yticks(range(len(classes)), classes)
        ax.set_xlabel("predicted"), ax.set_ylabel("true")
        for i in range(len(classes)):
            for j in range(len(classes)):
                ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8)
        ax.set_title(f"{scored[-1]['split']} videos, step {scored[-1]['step']}")
        fig.tight_layout()
        fig.savefig(out / "confusion.png", dpi=100)
        plt.close(fig)
        paths.append(out / "confusion.png")
    return paths
