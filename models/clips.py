"""Crops and flips of uint8 clip batches ``[B, T, H, W, 3]``, wherever they are (CPU or the device)."""

from __future__ import annotations

import torch


def center_crop(clips: torch.Tensor, crop: int | None) -> torch.Tensor:
    """The centre ``crop`` x ``crop`` of every frame (evaluation and prediction); unchanged when ``crop`` is None."""
    if crop is None:
        return clips
    h, w = clips.shape[2:4]
    top, left = (h - crop) // 2, (w - crop) // 2
    return clips[:, :, top : top + crop, left : left + crop].contiguous()


def random_crop_flip(clips: torch.Tensor, crop: int | None, flip: bool, generator: torch.Generator) -> torch.Tensor:
    """Training augmentation: a random crop per clip and, when ``flip``, a horizontal flip of half the clips.

    Flipping is off by default in the settings: it turns "moves left" into "moves right".
    """
    if crop is None and not flip:
        return clips
    _, _, h, w, _ = clips.shape
    out = []
    for clip in clips:
        if crop is not None:
            top = int(torch.randint(0, h - crop + 1, (1,), generator=generator))
            left = int(torch.randint(0, w - crop + 1, (1,), generator=generator))
            clip = clip[:, top : top + crop, left : left + crop]
        if flip and bool(torch.rand(1, generator=generator) < 0.5):
            clip = clip.flip(2)
        out.append(clip)
    return torch.stack(out).contiguous()
