"""The jpeg codec of a clip store: clips to per-frame JPEG bytes, and back on the host or on a device."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch  # the packer never imports torch; the device decode does, when called


def encode_jpeg(clips: np.ndarray, quality: int) -> np.ndarray:
    """``[N, T, H, W, 3]`` uint8 to an ``[N, T]`` object array of JPEG bytes (one per frame)."""
    from PIL import Image

    out = np.empty(clips.shape[:2], dtype=object)
    for i in range(clips.shape[0]):
        for t in range(clips.shape[1]):
            buffer = io.BytesIO()
            Image.fromarray(clips[i, t]).save(buffer, format="JPEG", quality=quality)
            out[i, t] = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
    return out


def decode_jpeg(frames: Iterable[np.ndarray]) -> np.ndarray:
    """JPEG bytes of each frame to ``[T, H, W, 3]`` uint8, with libjpeg-turbo through simplejpeg.

    simplejpeg decodes straight into an HWC array: 1.9x Pillow per core on 224x224 camera frames, where
    torchvision's ``decode_jpeg`` gave 1.4x (its CHW tensors need a transpose and a copy) and warns at
    every call that its image codecs are deprecated (torchvision 0.29).
    """
    import simplejpeg

    return np.stack([simplejpeg.decode_jpeg(np.asarray(f), colorspace="RGB") for f in frames])


def decode_jpeg_batch(clips: list[list[np.ndarray]], device) -> torch.Tensor:
    """Encoded clips (each a list of T frames' JPEG bytes) to ``[B, T, H, W, 3]`` uint8 on ``device``.

    One ``torchvision.io.decode_jpeg`` call over every frame of the batch: on a CUDA device that is
    nvJPEG's batched decode, and the host only moves the compressed bytes (about a tenth of the raw
    clip); on the CPU it is libjpeg-turbo, pixel for pixel what :func:`decode_jpeg` gives.
    """
    import warnings

    import torch
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    frames = [torch.from_numpy(np.asarray(f)) for clip in clips for f in clip]
    with warnings.catch_warnings():  # torchvision 0.29 warns at every call that its image codecs will move
        warnings.simplefilter("ignore")
        decoded = tv_decode_jpeg(frames, device=torch.device(device))
    t = len(clips[0]) if clips else 0
    return torch.stack(decoded).permute(0, 2, 3, 1).reshape(len(clips), t, *decoded[0].shape[1:], 3)
