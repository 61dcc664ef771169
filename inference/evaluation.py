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

from clipforge.models.clips import center_crop
from clipforge.preprocess.reader import ClipDataset

from .views import Views, spatial_crops


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def hits(scores: np.ndarray, labels: np.ndarray, k: int) -> int:
    """How many rows have their label among their ``k`` best scores (a partial sort, not a full one per row)."""
    if len(labels) == 0:
        return 0
    if k >= scores.shape[1]:
        return len(labels)
    if k == 1:
        return int((scores.argmax(axis=1) == labels).sum())
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return int((best == labels[:, None]).any(axis=1).sum())


SUMS = ("clips", "clip_top1", "clip_top5", "loss", "videos", "video_top1", "video_top5")


@dataclasses.dataclass
class Tally:
    """Sums over clips and whole videos that add across ranks: hits, the loss and the confusion matrix.

    Ranks score whole videos each and all-reduce these (8 MB at 1000 classes), never their logits: gathering
    every clip's logits onto every rank takes 4 GB a rank at 1M clips of 1000 classes.
    """

    classes: int
    sums: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(SUMS)))
    confusion: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.confusion = np.zeros((self.classes, self.classes), np.int64)

    def add_clips(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Clip-level hits and loss (cross-entropy, summed here) of ``logits``; returns their softmax rows."""
        z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        total = e.sum(axis=1, keepdims=True)
        probs = e / total
        rows = np.arange(len(labels))
        loss = float((np.log(total[:, 0]) - z[rows, labels]).sum())  # -log softmax at the label, without a 2nd exp
        self.sums[0:4] += [len(labels), hits(probs, labels, 1), hits(probs, labels, 5), loss]
        return probs

    def add_videos(self, video_probs: np.ndarray, video_labels: np.ndarray) -> None:
        """Video-level hits and the confusion matrix, from each video's mean softmax."""
        predicted = video_probs.argmax(axis=1) if len(video_labels) else np.zeros(0, np.int64)
        np.add.at(self.confusion, (video_labels, predicted), 1)
        self.sums[4:7] += [len(video_labels), hits(video_probs, video_labels, 1), hits(video_probs, video_labels, 5)]

    def add_logits(self, logits: np.ndarray, labels: np.ndarray, video_ids: np.ndarray) -> None:
        """Clips whose videos are all here (no clip of them elsewhere), scored at both levels."""
        probs = self.add_clips(logits, labels)
        # One pass over the clips, not one per video, which grew with clips x videos: 1.9 s at 64k clips of 16k.
        videos, first, of_video = np.unique(video_ids, return_index=True, return_inverse=True)
        video_probs = np.zeros((len(videos), probs.shape[1]))
        np.add.at(video_probs, of_video.reshape(-1), probs)
        video_probs /= np.bincount(of_video.reshape(-1), minlength=len(videos))[:, None].clip(min=1)
        self.add_videos(video_probs, labels[first].astype(np.int64))

    def merge(self, other: Tally) -> None:
        self.sums += other.sums
        self.confusion += other.confusion

    def all_reduce(self) -> None:
        """Every rank's sums added on every rank, in one collective."""
        from clipforge.hpc.distenv import collective_device

        flat = np.concatenate([self.sums, self.confusion.reshape(-1)])
        total = torch.from_numpy(flat).to(collective_device())
        torch.distributed.all_reduce(total)
        flat = total.cpu().numpy()
        self.sums = flat[: len(SUMS)].copy()
        self.confusion = np.rint(flat[len(SUMS) :]).astype(np.int64).reshape(self.classes, self.classes)

    def metrics(self, classes: list[str]) -> dict[str, Any]:
        """Clip and video top-1/top-5, the mean clip loss, per-class accuracy (video level), the confusion."""
        sums = dict(zip(SUMS, self.sums.tolist(), strict=True))
        clips, videos = max(sums["clips"], 1.0), max(sums["videos"], 1.0)
        rows = self.confusion.sum(axis=1)
        return {
            "clips": int(sums["clips"]),
            "clip_top1": sums["clip_top1"] / clips,
            "clip_top5": sums["clip_top5"] / clips,
            "videos": int(sums["videos"]),
            "video_top1": sums["video_top1"] / videos,
            "video_top5": sums["video_top5"] / videos,
            "per_class_accuracy": {
                c: float(self.confusion[i, i] / rows[i]) if rows[i] else None for i, c in enumerate(classes)
            },
            "confusion": self.confusion.tolist(),
            "loss": sums["loss"] / clips,
        }


def evaluate_logits(
    logits: np.ndarray, labels: np.ndarray, video_ids: np.ndarray, classes: list[str]
) -> dict[str, Any]:
    """Clip and video top-1/top-5, per-class accuracy (video level), the confusion matrix and the mean loss."""
    tally = Tally(len(classes))
    tally.add_logits(logits, labels, video_ids)
    return tally.metrics(classes)


@torch.no_grad()
def score(
    forward: Callable[[torch.Tensor], torch.Tensor],
    dataset: ClipDataset,
    positions: Sequence[int],
    batch: int,
    crop: int | None,
    device: torch.device | str = "cpu",
    workers: int = 0,
    batches: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of the clips at ``positions`` of ``dataset``, ``batch`` at a time, centre-cropped.

    Clips come through a DataLoader (``workers`` processes, pinned memory on a GPU); the logits stay on
    the device until the last batch, so the device never waits for the host between batches. At least
    ``batches`` forward passes run, the extra ones discarded (:func:`most_batches`).
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
    clips = None
    for clips, targets in loader:
        clips = center_crop(clips.to(device, non_blocking=cuda), crop).contiguous()
        logits.append(forward(clips).float())
        labels.append(targets)
    for _ in range(batches - len(logits)):
        forward(spare_batch(clips, dataset, crop, device))
    if not logits:
        return np.zeros((0, len(dataset.classes)), np.float32), np.zeros(0, np.int64)
    return torch.cat(logits).cpu().numpy(), torch.cat(labels).numpy().astype(np.int64)


def spare_batch(clips: torch.Tensor | None, dataset, crop: int | None, device: torch.device) -> torch.Tensor:
    """A batch for a forward pass whose output is discarded: the rank's last, or the split's first clip."""
    if clips is not None:
        return clips
    return center_crop(dataset[0][0][None].to(device), crop).contiguous()


def most_batches(count: int, world_size: int) -> int:
    """The most batches any rank has to score: every rank runs as many forward passes, since under ZeRO-3 each
    one gathers the weights from all ranks (a rank with a batch more would wait for the others forever)."""
    if world_size == 1:
        return count
    from clipforge.hpc.distenv import collective_device

    most = torch.tensor([count], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item())


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    dataset: ClipDataset,
    batch: int,
    crop: int | None,
    device: torch.device | str = "cpu",
    workers: int = 0,
) -> dict[str, Any]:
    """Accuracy of a plain (non-distributed) model on a split, in one process, on ``device``."""
    model.to(device).eval()
    order = np.arange(len(dataset))
    logits, labels = score(model, dataset, order, batch, crop, device, workers)
    return {**evaluate_logits(logits, labels, dataset.video_ids[order], dataset.classes), "split": dataset.split}


def videos_of_rank(video_ids: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The clip positions of every world-size-th video (whole videos, so each rank averages its own)."""
    _, dense = np.unique(video_ids, return_inverse=True)
    return np.flatnonzero(dense.reshape(-1) % world_size == rank)


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
    """Accuracy on a split, every rank scoring its share of the videos; every rank gets the metrics."""
    mine = videos_of_rank(dataset.video_ids, rank, world_size)
    batches = most_batches(-(-len(mine) // batch), world_size)  # whole videos: shares differ by a video's clips
    logits, labels = score(forward, dataset, mine, batch, crop, device, workers, batches)
    tally = Tally(len(dataset.classes))
    tally.add_logits(logits, labels, dataset.video_ids[mine])
    if world_size > 1:
        tally.all_reduce()
    return {**tally.metrics(dataset.classes), "split": dataset.split}


@dataclasses.dataclass
class VideoScores:
    """What one rank found over its videos, small enough to gather: sums and a confusion matrix, not a row a video."""

    tally: Tally
    failures: list[str] = dataclasses.field(default_factory=list)
    """One line per video that could not be decoded."""

    def add(self, label: int, logits: np.ndarray) -> None:
        probs = self.tally.add_clips(logits, np.full(len(logits), label))
        self.tally.add_videos(probs.mean(axis=0, keepdims=True), np.array([label]))

    @classmethod
    def merged(cls, parts: Iterable[VideoScores], classes: int) -> VideoScores:
        out = cls(Tally(classes))
        for p in parts:
            out.tally.merge(p.tally)
            out.failures += p.failures
        return out

    def metrics(self, classes: list[str]) -> dict[str, Any]:
        """The figures of :func:`evaluate_logits`, a view counting as a clip."""
        return {**self.tally.metrics(classes), "failed_videos": len(self.failures)}


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

    Each rank sends its :class:`VideoScores` (sums and a confusion matrix) to rank 0,
    which returns the metrics; the other ranks return None. Works with or without a process group.
    """
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = torch.utils.data.Subset(videos, range(rank, len(videos), world))
    loader = torch.utils.data.DataLoader(
        mine, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda", collate_fn=one_video
    )
    scores = VideoScores(Tally(len(classes)))
    for item in loader:
        if item["error"] is not None:
            scores.failures.append(item["error"])
        else:
            scores.add(item["label"], view_logits(forward, item["clips"], crop, views, batch, device))
        if progress is not None:
            progress(1)
    parts: list[Any] = [scores]
    if world > 1:
        from clipforge.hpc.distenv import wait_for_ranks

        wait_for_ranks("evaluated")  # the ranks' shares of videos end apart by more than a collective's timeout
        parts = [None] * world if rank == 0 else None
        dist.gather_object(scores, parts, dst=0)
    if rank != 0:
        return None
    merged = VideoScores.merged(parts, len(classes))
    return {**merged.metrics(classes), "views": views.label, "failures": merged.failures}


def one_video(item: dict[str, Any]) -> dict[str, Any]:
    """A loader's collate for one video: its clips as a tensor (so they can be pinned), the rest as it is."""
    if item["clips"] is not None:
        item = {**item, "clips": torch.from_numpy(np.ascontiguousarray(item["clips"]))}
    return item


@torch.no_grad()
def reconstruction_on_ranks(
    forward, dataset, batch: int, crop: int | None, rank: int, world_size: int, device, workers: int = 0, seed: int = 0
) -> dict[str, Any]:
    """The masked-reconstruction loss on a split, every rank taking its share, the masks drawn from ``seed``."""
    cuda = torch.device(device).type == "cuda"
    mine = np.arange(rank, len(dataset), world_size)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, list(mine)), batch_size=batch, num_workers=workers, pin_memory=cuda
    )
    batches = most_batches(-(-len(mine) // batch), world_size)  # as many forward passes on every rank (ZeRO-3)
    torch.manual_seed(seed)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    clips, done = None, 0
    for clips, _ in loader:
        clips = center_crop(clips.to(device, non_blocking=cuda), crop).contiguous()
        total += torch.stack([forward(clips).double() * len(clips), torch.tensor(float(len(clips)), device=device)])
        done += 1
    for _ in range(batches - done):
        forward(spare_batch(clips, dataset, crop, torch.device(device)))
    if world_size > 1:
        from clipforge.hpc.distenv import collective_device

        total = total.to(collective_device())
        torch.distributed.all_reduce(total)
    loss, clips = total.tolist()
    return {"split": dataset.split, "loss": loss / max(clips, 1.0), "clips": int(clips)}
