"""Accuracy the way video papers report it, of a plain model or of every rank of a running engine.

Clip level scores every clip; video level averages the softmax of a video's
clips first (as VideoMAE and SlowFast report).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from clipforge.preprocess.reader import ClipDataset

from .clips import center_crop


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


def evaluate_logits(
    logits: np.ndarray, labels: np.ndarray, video_ids: np.ndarray, classes: list[str]
) -> dict[str, Any]:
    """Clip and video top-1/top-5, per-class accuracy (video level) and the confusion matrix."""
    probs = softmax(logits.astype(np.float64))
    videos = np.unique(video_ids)
    video_probs = (
        np.stack([probs[video_ids == v].mean(axis=0) for v in videos]) if len(videos) else np.zeros((0, len(classes)))
    )
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


def split_metrics(logits: np.ndarray, labels: np.ndarray, dataset: ClipDataset, order: np.ndarray) -> dict[str, Any]:
    """Everything a run reports of a split: accuracy at both levels, the loss, the split's name."""
    metrics = evaluate_logits(logits, labels, dataset.video_ids[order], dataset.classes)
    loss = F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels)) if len(labels) else torch.tensor(0.0)
    metrics["loss"] = float(loss.item())
    metrics["split"] = dataset.split
    return metrics


@torch.no_grad()
def score(
    forward: Callable[[torch.Tensor], torch.Tensor],
    dataset: ClipDataset,
    positions: Sequence[int],
    batch: int,
    crop: int | None,
    device: torch.device | str = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of the clips at ``positions`` of ``dataset``, ``batch`` at a time, centre-cropped."""
    logits, labels = [], []
    for start in range(0, len(positions), batch):
        items = [dataset[i] for i in positions[start : start + batch]]
        clips = center_crop(torch.stack([c for c, _ in items]).to(device), crop)
        logits.append(forward(clips.contiguous()).float().cpu())
        labels.extend(y for _, y in items)
    scores = torch.cat(logits).numpy() if logits else np.zeros((0, len(dataset.classes)))
    return scores, np.array(labels, np.int64)


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, dataset: ClipDataset, batch: int, crop: int | None) -> dict[str, Any]:
    """Accuracy of a plain (non-distributed) model on a split, in one process."""
    model.eval()
    order = np.arange(len(dataset))
    logits, labels = score(model, dataset, order, batch, crop)
    return split_metrics(logits, labels, dataset, order)


@torch.no_grad()
def evaluate_on_ranks(
    forward: Callable[[torch.Tensor], torch.Tensor],
    dataset: ClipDataset,
    batch: int,
    crop: int | None,
    rank: int,
    world_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Accuracy on a split, every rank scoring its share of the clips; every rank gets the metrics."""
    mine = np.arange(rank, len(dataset), world_size)
    logits, labels = score(forward, dataset, mine, batch, crop, device)
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, (logits, labels, mine))
    all_logits, all_labels, order = (np.concatenate([g[k] for g in gathered]) for k in range(3))
    return split_metrics(all_logits, all_labels, dataset, order)
