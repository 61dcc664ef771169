"""Multi-view testing: several clips in time, several crops in space, one averaged prediction per video.

The anchors report Kinetics accuracy this way: VideoMAE with 5 temporal clips
x 3 spatial crops, SlowFast with 10 x 3. Temporal views are clips spread
evenly over the video (from the store, or decoded again from the source
file with the store's clip parameters); spatial views are ``crop``-sized
windows spread along the frame's long side, centred on the short side. A
video's prediction is the mean of the softmax of all its views.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

from clipforge.base.errors import UserError


class ViewsError(UserError):
    """Views that the clips cannot give; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Views:
    temporal: int = 0
    """Clips per video, spread evenly over it (0: every clip the store holds for it)."""
    spatial: int = 1
    """Crops per clip along the frame's long side (1: the centre; 3: as VideoMAE and SlowFast)."""
    source: Literal["store", "videos"] = "store"
    """Take the clips from the store, or decode them again from the source videos (any number of them)."""

    def check(self, crop: int | None, height: int, width: int) -> Views:
        """Refuse views the clips cannot give, in one line."""
        if self.temporal < 0 or self.spatial < 1:
            raise ViewsError(
                f"views: temporal must be 0 or more and spatial 1 or more, got {self.temporal} x {self.spatial}"
            )
        if self.spatial > 1 and (crop is None or crop >= max(height, width)):
            raise ViewsError(
                f"views.spatial {self.spatial}: the model sees the whole {height}x{width} frame (crop "
                f"{crop}), so all crops would be the same; use --views.spatial 1 or train with a smaller crop"
            )
        return self

    @property
    def label(self) -> str:
        clips = f"{self.temporal} clips" if self.temporal else "the stored clips"
        return f"{clips} x {self.spatial} crop{'s' if self.spatial > 1 else ''}, from the {self.source}"


def spatial_crops(clips: torch.Tensor, crop: int | None, count: int) -> torch.Tensor:
    """``[K, T, H, W, 3]`` to ``[K * count, T, crop, crop, 3]``: ``count`` crops of every clip, clip-major."""
    if crop is None:
        return clips
    _, _, h, w, _ = clips.shape
    long_side, along_width = max(h, w), w >= h
    starts = [(long_side - crop) // 2] if count == 1 else np.linspace(0, long_side - crop, count).round().astype(int)
    centre = ((h if along_width else w) - crop) // 2
    views = []
    for s in starts:
        top, left = (centre, int(s)) if along_width else (int(s), centre)
        views.append(clips[:, :, top : top + crop, left : left + crop])
    return torch.stack(views, dim=1).flatten(0, 1).contiguous()
