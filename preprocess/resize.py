"""Frames to the store's geometry: scale the short side (or stretch), turn by the stream's rotation, centre-crop.

One swscale context per thread serves every frame of every video a process decodes.
"""

from __future__ import annotations

import threading

import av
import av.video.reformatter
import numpy as np


class Resizer:
    """One swscale context reused for every frame (1.5-3x faster than a new one per frame) and every video.

    The geometry is worked out once per frame size and rotation: reading the rotation from each
    frame's side data and recomputing it was a visible part of the per-frame cost.
    """

    def __init__(self, height: int, width: int, resize: str) -> None:
        """``resize``: "stretch" to height x width, or anything else to scale the short side and centre-crop."""
        self.height, self.width, self.resize = height, width, resize
        self.reformatter = _reformatter()
        self.rotation: int | None = None
        self.geometry: dict[tuple[int, int], tuple[int, int, int, int]] = {}

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        if self.rotation is None:  # quarter turns counter-clockwise, from the stream's display matrix
            self.rotation = int(round((frame.rotation or 0) / 90)) % 4
        size = (frame.width, frame.height)
        if size not in self.geometry:
            self.geometry[size] = self._geometry(*size)
        cw, ch, top, left = self.geometry[size]
        rgb = self.reformatter.reformat(frame, width=cw, height=ch, format="rgb24", interpolation="BILINEAR", threads=1)
        img = rgb.to_ndarray()
        if self.rotation:
            img = np.rot90(img, k=self.rotation)
        return img[top : top + self.height, left : left + self.width]

    def _geometry(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(scaled width, scaled height) before turning, and the crop's (top, left) after."""
        turned = self.rotation % 2
        w, h = (height, width) if turned else (width, height)
        if self.resize == "stretch":
            dw, dh = self.width, self.height
        else:
            scale = max(self.width / w, self.height / h)
            dw, dh = max(self.width, round(w * scale)), max(self.height, round(h * scale))
        cw, ch = (dh, dw) if turned else (dw, dh)
        return cw, ch, (dh - self.height) // 2, (dw - self.width) // 2


_per_thread = threading.local()


def _reformatter() -> av.video.reformatter.VideoReformatter:
    """This thread's swscale context, kept from video to video: a new one per video costs a visible share of
    decoding a short one. FFmpeg rebuilds it only when a frame's size or format differs from the last."""
    if not hasattr(_per_thread, "reformatter"):
        _per_thread.reformatter = av.video.reformatter.VideoReformatter()
    return _per_thread.reformatter
