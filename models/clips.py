"""Crops, flips, mixup and CutMix of clip batches ``[B, T, H, W, 3]``, wherever they are (CPU or the device)."""

from __future__ import annotations

import math

import numpy as np
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


def mix_batch(
    clips: torch.Tensor,
    labels: torch.Tensor,
    classes: int,
    mixup: float,
    cutmix: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or CutMix of a micro-batch with itself reversed: float clips and soft targets ``[B, classes]``.

    Mixup blends whole clips by ``lam ~ Beta(mixup, mixup)``; CutMix pastes one box, the same in every
    frame, of area share ``1 - lam`` with ``lam ~ Beta(cutmix, cutmix)``, and weighs the labels by the
    area actually pasted. With both on, each micro-batch uses one of them, evenly (as timm's Mixup does).
    Every draw comes from ``generator``, so a resumed run mixes its batches the same way.
    """
    targets = torch.nn.functional.one_hot(labels.long(), classes).float()
    if not (mixup or cutmix):
        return clips, targets
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    use_cutmix = bool(cutmix) and (not mixup or rng.random() < 0.5)
    lam = float(rng.beta(cutmix, cutmix) if use_cutmix else rng.beta(mixup, mixup))
    other = clips.flip(0)
    if use_cutmix:
        _, _, h, w, _ = clips.shape
        cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        mixed = clips.clone()
        mixed[:, :, top:bottom, left:right] = other[:, :, top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (h * w)
        mixed = mixed.float()
    else:
        mixed = clips.float() * lam + other.float() * (1 - lam)
    return mixed, targets * lam + targets.flip(0) * (1 - lam)
