"""Accuracy the way video papers report it, of a plain model or of every rank of a running engine.

Clip level scores every clip; video level averages the softmax of a video's
clips first (as VideoMAE and SlowFast report).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from clipforge.preprocess.reader import ClipDataset

from .clips import center_crop
from .views import Views, spatial_crops


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
    # One pass over the clips, not one per video, which grew with clips x videos: 1.9 s at 64k clips of 16k videos.
    videos, first, of_video = np.unique(video_ids, return_index=True, return_inverse=True)
    video_probs = np.zeros((len(videos), probs.shape[1]))
    np.add.at(video_probs, of_video.reshape(-1), probs)
    video_probs /= np.bincount(of_video.reshape(-1), minlength=len(videos))[:, None].clip(min=1)
    video_labels = labels[first].astype(np.int64)
    return {
        "clips": int(len(labels)),
        "clip_top1": topk(probs, labels, 1),
        "clip_top5": topk(probs, labels, 5),
        **video_metrics(video_probs, video_labels, classes),
    }


def video_metrics(video_probs: np.ndarray, video_labels: np.ndarray, classes: list[str]) -> dict[str, Any]:
    """Video top-1/top-5, per-class accuracy and the confusion matrix, from each video's averaged softmax."""
    predicted = video_probs.argmax(axis=1) if len(video_labels) else np.zeros(0, np.int64)
    confusion = np.zeros((len(classes), len(classes)), dtype=np.int64)
    np.add.at(confusion, (video_labels, predicted), 1)
    per_class = {
        c: float(confusion[i, i] / confusion[i].sum()) if confusion[i].sum() else None for i, c in enumerate(classes)
    }
    return {
        "videos": int(len(video_labels)),
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
    workers: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of the clips at ``positions`` of ``dataset``, ``batch`` at a time, centre-cropped.

    Clips come through a DataLoader (``workers`` processes, pinned memory on a GPU); the logits stay on
    the device until the last batch, so the device never waits for the host between batches.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, list(positions)),
        batch_size=batch,
        num_workers=workers,
        pin_memory=cuda,
        prefetch_factor=4 if workers else None,
    )
    logits, labels = [], []
    for clips, targets in loader:
        clips = center_crop(clips.to(device, non_blocking=cuda), crop)
        logits.append(forward(clips.contiguous()).float())
        labels.append(targets)
    if not logits:
        return np.zeros((0, len(dataset.classes))), np.zeros(0, np.int64)
    return torch.cat(logits).cpu().numpy(), torch.cat(labels).numpy().astype(np.int64)


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
    workers: int = 0,
) -> dict[str, Any]:
    """Accuracy on a split, every rank scoring its share of the clips; every rank gets the metrics."""
    mine = np.arange(rank, len(dataset), world_size)
    logits, labels = score(forward, dataset, mine, batch, crop, device, workers)
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, (logits, labels, mine))
    all_logits, all_labels, order = (np.concatenate([g[k] for g in gathered]) for k in range(3))
    return split_metrics(all_logits, all_labels, dataset, order)


@dataclasses.dataclass
class VideoScores:
    """What one rank found over its videos, small enough to gather: a softmax row per video, counts per view."""

    videos: list[int] = dataclasses.field(default_factory=list)
    labels: list[int] = dataclasses.field(default_factory=list)
    probs: list[np.ndarray] = dataclasses.field(default_factory=list)
    """The mean softmax of each video's views."""
    views: int = 0
    view_top1: int = 0
    view_top5: int = 0
    view_loss: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)
    """One line per video that could not be decoded."""

    def add(self, video: int, label: int, logits: np.ndarray) -> None:
        probs = softmax(logits.astype(np.float64))
        labels = np.full(len(probs), label)
        self.videos.append(video)
        self.labels.append(label)
        self.probs.append(probs.mean(axis=0))
        self.views += len(probs)
        self.view_top1 += round(topk(probs, labels, 1) * len(probs))
        self.view_top5 += round(topk(probs, labels, 5) * len(probs))
        self.view_loss += float(-np.log(np.maximum(probs[:, label], 1e-12)).sum())

    @classmethod
    def merged(cls, parts: Iterable[VideoScores]) -> VideoScores:
        out = cls()
        for p in parts:
            out.videos += p.videos
            out.labels += p.labels
            out.probs += p.probs
            out.failures += p.failures
            out.views += p.views
            out.view_top1 += p.view_top1
            out.view_top5 += p.view_top5
            out.view_loss += p.view_loss
        return out

    def metrics(self, classes: list[str]) -> dict[str, Any]:
        """The figures of :func:`evaluate_logits`, a view counting as a clip."""
        order = np.argsort(self.videos, kind="stable")
        probs = np.stack(self.probs)[order] if self.probs else np.zeros((0, len(classes)))
        n = max(self.views, 1)
        return {
            "clips": self.views,
            "clip_top1": self.view_top1 / n,
            "clip_top5": self.view_top5 / n,
            "loss": self.view_loss / n,
            **video_metrics(probs, np.array(self.labels, np.int64)[order], classes),
            "failed_videos": len(self.failures),
        }


def inference(model: torch.nn.Module, device: torch.device, precision: str = "auto") -> Callable:
    """``model`` on ``device``, in eval mode, as a forward function: bf16 autocast on a GPU unless fp32 is asked."""
    model = model.to(device).eval()
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")

    @torch.no_grad()
    def forward(clips: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return model(clips)

    return forward


@torch.no_grad()
def view_logits(
    forward: Callable[[torch.Tensor], torch.Tensor],
    clips: torch.Tensor,
    crop: int | None,
    views: Views,
    batch: int,
    device: torch.device,
) -> np.ndarray:
    """Logits of every view of one video's clips ``[K, T, H, W, 3]`` (uint8), ``batch`` views per forward pass."""
    clips = clips.to(device, non_blocking=device.type == "cuda")
    crops = spatial_crops(clips, crop, views.spatial)
    out = [forward(crops[i : i + batch]).float().cpu() for i in range(0, len(crops), batch)]
    return torch.cat(out).numpy()


@torch.no_grad()
def evaluate_videos_on_ranks(
    forward: Callable[[torch.Tensor], torch.Tensor],
    videos: torch.utils.data.Dataset,
    classes: list[str],
    crop: int | None,
    views: Views,
    batch: int,
    device: torch.device,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any] | None:
    """Multi-view accuracy of the per-video dataset ``videos``, ranks taking every world-size-th video.

    Each rank sends its :class:`VideoScores` (a row per video, not a row per view) to rank 0,
    which returns the metrics; the other ranks return None. Works with or without a process group.
    """
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = torch.utils.data.Subset(videos, range(rank, len(videos), world))
    loader = torch.utils.data.DataLoader(
        mine, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda", collate_fn=one_video
    )
    scores = VideoScores()
    for item in loader:
        if item["error"] is not None:
            scores.failures.append(item["error"])
        else:
            scores.add(item["video"], item["label"], view_logits(forward, item["clips"], crop, views, batch, device))
        if progress is not None:
            progress(1)
    parts: list[Any] = [scores]
    if world > 1:
        parts = [None] * world if rank == 0 else None
        dist.gather_object(scores, parts, dst=0)
    if rank != 0:
        return None
    merged = VideoScores.merged(parts)
    return {**merged.metrics(classes), "views": views.label, "failures": merged.failures}


def one_video(item: dict[str, Any]) -> dict[str, Any]:
    """A loader's collate for one video: its clips as a tensor (so they can be pinned), the rest as it is."""
    if item["clips"] is not None:
        item = {**item, "clips": torch.from_numpy(np.ascontiguousarray(item["clips"]))}
    return item
