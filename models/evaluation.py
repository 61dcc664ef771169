"""Accuracy the way video papers report it, and the plots a person reads.

Clip level scores every clip; video level averages the softmax of a video's
clips first (as VideoMAE and SlowFast report).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def topk(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    if len(labels) == 0:
        return 0.0
    k = min(k, scores.shape[1])
    best = np.argsort(-scores, axis=1)[:, :k]
    return float((best == labels[:, None]).any(axis=1).mean())


def evaluate_logits(logits: np.ndarray, labels: np.ndarray, video_ids: np.ndarray, classes: list[str]) -> dict[str, Any]:
    """Clip and video top-1/top-5, per-class accuracy (video level) and the confusion matrix."""
    probs = softmax(logits.astype(np.float64))
    videos = np.unique(video_ids)
    video_probs = np.stack([probs[video_ids == v].mean(axis=0) for v in videos]) if len(videos) else np.zeros((0, len(classes)))
    video_labels = np.array([labels[video_ids == v][0] for v in videos], dtype=np.int64)
    predicted = video_probs.argmax(axis=1) if len(videos) else np.zeros(0, np.int64)
    confusion = np.zeros((len(classes), len(classes)), dtype=np.int64)
    for truth, guess in zip(video_labels, predicted):
        confusion[truth, guess] += 1
    per_class = {
        c: float(confusion[i, i] / confusion[i].sum()) if confusion[i].sum() else None for i, c in enumerate(classes)
    }
    return {
        "clips": int(len(labels)),
        "videos": int(len(videos)),
        "clip_top1": topk(probs, labels, 1),
        "clip_top5": topk(probs, labels, 5),
        "video_top1": topk(video_probs, video_labels, 1),
        "video_top5": topk(video_probs, video_labels, 5),
        "per_class_accuracy": per_class,
        "confusion": confusion.tolist(),
    }


def plot_run(run_dir: Path, classes: list[str]) -> list[Path]:
    """Loss and accuracy curves from metrics.jsonl and the last confusion matrix, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train" and "loss" in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label=f"{evals[-1]['split']} loss")
        ax2.plot([r["step"] for r in evals], [r["clip_top1"] for r in evals], "o-", label="clip top-1")
        ax2.plot([r["step"] for r in evals], [r["video_top1"] for r in evals], "s-", label="video top-1")
        ax2.set_ylim(0, 1)
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend()
    ax2.set_xlabel("step"), ax2.set_ylabel("accuracy"), ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)
    paths.append(out / "curves.png")
    if evals:
        confusion = np.array(evals[-1]["confusion"])
        fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(classes), 1 + 0.6 * len(classes)))
        ax.imshow(confusion, cmap="Blues")
        ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
        ax.set_yticks(range(len(classes)), classes)
        ax.set_xlabel("predicted"), ax.set_ylabel("true")
        for i in range(len(classes)):
            for j in range(len(classes)):
                ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8)
        ax.set_title(f"{evals[-1]['split']} videos, step {evals[-1]['step']}")
        fig.tight_layout()
        fig.savefig(out / "confusion.png", dpi=100)
        plt.close(fig)
        paths.append(out / "confusion.png")
    return paths
