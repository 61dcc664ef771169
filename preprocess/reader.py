"""Reading clips for a model: a Dataset over one split of a store, and the views of whole videos.

:class:`ClipDataset` returns ``(clip, label)`` with ``clip`` a ``[T, H, W, 3]``
uint8 tensor: conversion to float, normalisation and layout belong on the
device, where they are cheap (the crops and flips are in
:mod:`clipforge.models.clips`). It has a length, so ``DistributedSampler``
shards it.

:class:`StoredVideos` and :class:`DecodedVideos` return one video per item
(its clips ``[K, T, H, W, 3]``), for multi-view testing and prediction: from
the store, or decoded from video files with the store's clip parameters. A
file that cannot be decoded becomes an item with an ``error``, never an
exception that stops the loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .decode import ClipParams, VideoError, decode_clips
from .store import ClipStore
from .store_format import StoreError


class ClipDataset(Dataset):
    """The clips of one split of a clip store, in index order (by video, then clip)."""

    def __init__(self, store: Path | ClipStore, split: str = "train", transform=None, encoded: bool = False) -> None:
        self.store = store if isinstance(store, ClipStore) else ClipStore.open(Path(store))
        if split not in self.store.splits:
            raise StoreError(
                f"split {split!r} is not in {self.store.root}; choose one of {', '.join(self.store.splits)}"
            )
        self.split = split
        self.positions = self.store.splits[split]
        self.transform = transform
        self.encoded = encoded
        """Return a jpeg store's frames undecoded (a list of JPEG byte arrays), for decoding on the device."""
        if encoded and self.store.codec != "jpeg":
            raise StoreError(
                f"{self.store.root} holds {self.store.codec} clips, so there is nothing to decode on the device; "
                "decode on the host (the default), or pack the store with --codec jpeg"
            )

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        position = int(self.positions[i])
        if self.encoded:
            return self.store.read_encoded(position), int(self.store.labels[position])
        clip = torch.from_numpy(np.ascontiguousarray(self.store.read_clip(position)))
        if self.transform is not None:
            clip = self.transform(clip)
        return clip, int(self.store.labels[position])

    @property
    def labels(self) -> np.ndarray:
        """Labels of this split's clips, in dataset order (for class-balanced sampling and weights)."""
        return self.store.labels[self.positions]

    @property
    def shards(self) -> np.ndarray:
        """The shard each clip is in, in dataset order (for locality-aware sampling)."""
        return self.store.shard_of(self.positions)

    @property
    def video_ids(self) -> np.ndarray:
        """Video of each clip, in dataset order (for video-level accuracy)."""
        return self.store.video_ids[self.positions]

    @property
    def classes(self) -> list[str]:
        return self.store.classes


def collate_encoded(items: list[tuple[list[np.ndarray], int]]) -> tuple[list[list[np.ndarray]], torch.Tensor]:
    """A batch of encoded clips: the frames as they are (each frame's bytes differ in length), labels stacked."""
    return [clip for clip, _ in items], torch.tensor([label for _, label in items])


def evenly(available: int, wanted: int) -> np.ndarray:
    """Indices of ``wanted`` of ``available`` items spread evenly (all of them for 0, or for more than there are)."""
    if wanted == 0 or wanted >= available:
        return np.arange(available)
    if wanted == 1:
        return np.array([(available - 1) // 2])
    return np.round(np.linspace(0, available - 1, wanted)).astype(np.int64)


def video_item(video: int, label: int, clips: np.ndarray | None, error: str | None = None) -> dict[str, Any]:
    """One video of a per-video dataset: its id, label (-1: unknown), clips ``[K, T, H, W, 3]`` or why none."""
    return {"video": video, "label": label, "clips": clips, "error": error}


class StoredVideos(Dataset):
    """The videos of one split of a store, with ``temporal`` of each one's stored clips (0: all)."""

    def __init__(self, store: Path | ClipStore, split: str, temporal: int = 0) -> None:
        clips = ClipDataset(store, split)
        self.store, self.split, self.temporal = clips.store, split, temporal
        ids = clips.video_ids
        # Split positions are in index order, by video then clip: each video's clips are one run.
        self.video_ids, starts, counts = np.unique(ids, return_index=True, return_counts=True)
        self.runs = [clips.positions[a : a + n] for a, n in zip(starts, counts)]

    def __len__(self) -> int:
        return len(self.video_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        run = self.runs[i][evenly(len(self.runs[i]), self.temporal)]
        clips = np.stack([self.store.read_clip(int(p)) for p in run])
        return video_item(int(self.video_ids[i]), int(self.store.labels[run[0]]), clips)


class DecodedVideos(Dataset):
    """Video files decoded with ``params``, ``temporal`` clips spread over each (0: as ``params`` says)."""

    def __init__(
        self,
        paths: Sequence[Path],
        params: ClipParams,
        temporal: int = 0,
        labels: Sequence[int] | None = None,
        video_ids: Sequence[int] | None = None,
    ) -> None:
        self.paths = list(paths)
        if temporal:
            params = dataclasses.replace(params, sampling="uniform", clips_per_video=temporal)
        self.params = params
        self.labels = list(labels) if labels is not None else [-1] * len(self.paths)
        self.video_ids = list(video_ids) if video_ids is not None else list(range(len(self.paths)))

    @classmethod
    def of_split(cls, store: ClipStore, split: str, temporal: int, root: Path | None = None) -> DecodedVideos:
        """The source videos of a split of ``store``, decoded again like the store's clips."""
        videos = StoredVideos(store, split).video_ids
        params = ClipParams.recorded(store.params)
        labels = store.videos["label"][videos]
        return cls(store.source_paths(videos, root), params, temporal, labels, videos)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.paths[i]
        try:
            decoded = decode_clips(path, self.params)
        except (VideoError, OSError) as exc:
            return video_item(self.video_ids[i], self.labels[i], None, f"{path}: {exc}")
        if not len(decoded.clips):
            return video_item(self.video_ids[i], self.labels[i], None, f"{path}: {decoded.status}")
        return video_item(self.video_ids[i], self.labels[i], decoded.clips)
