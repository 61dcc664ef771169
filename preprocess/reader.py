"""Reading the clip store for training: a Dataset over one split.

The dataset returns ``(clip, label)`` with ``clip`` a ``[T, H, W, 3]`` uint8
tensor: conversion to float, normalisation and layout belong on the device,
where they are cheap (the crops and flips are in :mod:`clipforge.models.clips`).
It has a length, so ``DistributedSampler`` shards it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .store import ClipStore, StoreError


class ClipDataset(Dataset):
    """The clips of one split of a clip store, in index order (by video, then clip)."""

    def __init__(self, store: Path | ClipStore, split: str = "train", transform=None) -> None:
        self.store = store if isinstance(store, ClipStore) else ClipStore.open(Path(store))
        if split not in self.store.splits:
            raise StoreError(
                f"split {split!r} is not in {self.store.root}; choose one of {', '.join(self.store.splits)}"
            )
        self.split = split
        self.positions = self.store.splits[split]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        position = int(self.positions[i])
        clip = torch.from_numpy(np.ascontiguousarray(self.store.read_clip(position)))
        if self.transform is not None:
            clip = self.transform(clip)
        return clip, int(self.store.labels[position])

    @property
    def labels(self) -> np.ndarray:
        """Labels of this split's clips, in dataset order (for class-balanced sampling and weights)."""
        return self.store.labels[self.positions]

    @property
    def video_ids(self) -> np.ndarray:
        """Video of each clip, in dataset order (for video-level accuracy)."""
        return self.store.video_ids[self.positions]

    @property
    def classes(self) -> list[str]:
        return self.store.classes
