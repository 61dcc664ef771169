"""A conformance corpus: small files of the kinds that break video loaders, each frame carrying its number.

Every frame has a binary bar code of its label drawn into the middle of the
picture (eight large blocks, bright for 1, dark for 0), large enough to
survive compression, scaling and the centre crop, so a test can read back from
every packed frame which source frame it is. The label is the frame's number
in display order, or for variable-frame-rate files its time slot.

Each :class:`Case` says what clipforge must do with its file: pack it
frame-exact (``exact``), pack what decodes and report it (``partial``,
``damaged``), or refuse it with a reason (``error``); and which timing it must
choose. Files are seconds of tiny frames, so the whole corpus packs in seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import numpy as np

from .synthetic import tag_rotation

BITS = 8
FPS = 25
FRAMES = 60


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    """File name in the corpus folder."""
    what: str
    """What it exercises."""
    expect: Literal["exact", "partial", "damaged", "error"]
    timing: Literal["pts", "order"] | None = None
    """The timing clipforge must choose (None: an error case)."""
    truth: Literal["decode", "position", "slot"] = "decode"
    """What a label means. decode: the frame's place in a plain decode of the whole file (what players show);
    position: its display position as encoded (where a plain decode stops at damage); slot: its time slot."""
    slot: float = 0.0
    """For truth ``slot``: seconds per slot."""
    size: tuple[int, int] = (128, 96)
    """Displayed width and height."""
    rotation: int = 0
    """Quarter turns counter-clockwise that the display applies (a rotation tag; 3 is a quarter turn clockwise)."""
    reason: str = ""
    """For an error case: text the reason must contain."""


def barcode(label: int, width: int, height: int) -> np.ndarray:
    """A ``[H, W, 3]`` frame showing ``label`` as BITS blocks in a 4 x 2 grid around the centre."""
    img = np.full((height, width, 3), 96, np.uint8)
    block = min(width, height) // 6
    for bit in range(BITS):
        y, x = _block_origin(bit, width / 2, height / 2, block)
        img[y : y + block, x : x + block] = 235 if (label >> bit) & 1 else 16
    return img


def read_label(img: np.ndarray, size: tuple[int, int], rotation: int = 0) -> int:
    """The label drawn in a decoded (scaled, centre-cropped, maybe turned) frame of a video of ``size``."""
    img = np.rot90(img, k=-rotation) if rotation else img
    height, width = img.shape[:2]
    scale = max(width / size[0], height / size[1])  # the short side scaled to fit, then the centre cropped
    block = (min(size) // 6) * scale
    label = 0
    for bit in range(BITS):
        y, x = _block_origin(bit, width / 2, height / 2, block)
        c, r = int(x + block / 2), int(y + block / 2)
        half = max(1, int(block / 5))
        if img[r - half : r + half, c - half : c + half].mean() > 128:
            label |= 1 << bit
    return label


def _block_origin(bit: int, cx: float, cy: float, block: float) -> tuple[int, int]:
    row, col = divmod(bit, 4)
    return int(cy - block + row * block), int(cx - 2 * block + col * block)


def write_corpus(root: Path) -> list[Case]:
    """Write every case's file under ``root``; returns the cases in file-name order."""
    root.mkdir(parents=True, exist_ok=True)
    cases = []
    for case, write in _CASES:
        write(root / case.name)
        cases.append(case)
    return sorted(cases, key=lambda c: c.name)


# --------------------------------------------------------------------------- encoding
def _encode(
    path: Path,
    codec: str,
    *,
    labels: list[int] | None = None,
    pts: list[int] | None = None,
    time_base: Fraction | None = None,
    b_frames: int = 0,
    pix_fmt: str = "yuv420p",
    size: tuple[int, int] = (128, 96),
    options: dict[str, str] | None = None,
    rewrite: Callable[[int, av.Packet], None] | None = None,
) -> None:
    """Encode frames showing ``labels`` (default 0..FRAMES-1) at timestamps ``pts`` (default their positions)."""
    labels = list(range(FRAMES)) if labels is None else labels
    pts = list(range(len(labels))) if pts is None else pts
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], pix_fmt
        stream.codec_context.gop_size = 12
        stream.codec_context.max_b_frames = b_frames
        if time_base is not None:
            stream.time_base = stream.codec_context.time_base = time_base
        stream.options = options or ({"crf": "8", "preset": "ultrafast"} if codec == "libx264" else {"qscale": "2"})
        if codec == "libx264" and b_frames:
            stream.options = {**stream.options, "preset": "medium", "bframes": str(b_frames)}
        packets = []
        for label, t in zip(labels, pts):
            frame = av.VideoFrame.from_ndarray(barcode(label, *size), format="rgb24").reformat(format=pix_fmt)
            frame.pts = t
            if time_base is not None:
                frame.time_base = time_base
            packets += stream.encode(frame)
        packets += stream.encode()
        for i, packet in enumerate(packets):
            if rewrite:
                rewrite(i, packet)
            out.mux(packet)


def _broken_composition_offsets(i: int, packet: av.Packet) -> None:
    packet.pts = packet.dts  # an MP4 whose ctts is lost: B-frames come out in display order with wrong pts


def _rewritten_timestamps(i: int, packet: av.Packet) -> None:
    # Swap the timestamps of every second pair: decode order is display order, the stamps say otherwise.
    j = i + 1 if i % 4 == 1 else i - 1 if i % 4 == 2 else i
    packet.pts, packet.dts = j * 512, (i - 1) * 512  # dts one frame behind, so that no pts is below its dts


def _held_frames(path: Path) -> None:
    # Every fifth slot dropped: the AVI muxer writes an empty placeholder there, and players keep
    # the previous frame on screen. Labels are slots, so the frame on screen at slot n is known.
    slots = [n for n in range(75) if n % 5 != 3]
    _encode(path, "mpeg4", labels=slots, pts=slots)


def _variable_rate(path: Path) -> None:
    # Steps of 20 and 40 ms: labels are 20 ms slots.
    slots = np.cumsum([0] + [1 if i % 3 == 0 else 2 for i in range(FRAMES - 1)]).tolist()
    _encode(path, "libx264", labels=slots, pts=[20 * s for s in slots], time_base=Fraction(1, 1000))


def _edit_list(path: Path) -> None:
    # Timestamps from -5 frames: the muxer writes an edit list and players start at label 5.
    _encode(path, "libx264", pts=[i - 5 for i in range(FRAMES)], b_frames=2)


def _rotated(path: Path) -> None:
    _encode(path, "libx264")
    tag_rotation(path, 90)


def _truncated(path: Path) -> None:
    _encode(path, "mpeg4", labels=list(range(100)))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.75)])  # the header still promises 100 frames


def _corrupt_gop(path: Path) -> None:
    _encode(path, "libx264", labels=list(range(100)))
    with av.open(str(path)) as container:
        spans = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    for pos, size in spans[50:58]:  # the middle of the file, from a keyframe on
        data[pos + 4 : pos + size] = rng.integers(0, 256, size - 4, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def _audio_only(path: Path) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("aac", rate=8000)
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 8000, i * 1024
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _zero_frames(path: Path) -> None:
    # An AVI keeps its stream header without a frame (an empty MP4 or Matroska file loses the track itself).
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        out.start_encoding()


_CASES: list[tuple[Case, Callable[[Path], None]]] = [
    (
        Case("mpeg4_bframes.avi", "MPEG-4 Part 2 with B-frames in AVI (XviD-like)", "exact", "pts"),
        lambda p: _encode(p, "mpeg4", b_frames=2),
    ),
    (Case("msmpeg4.avi", "MS-MPEG4 v3 in AVI (DivX 3)", "exact", "pts"), lambda p: _encode(p, "msmpeg4v3")),
    (
        Case("h264_bframes.mp4", "H.264 with B-frames in MP4", "exact", "pts"),
        lambda p: _encode(p, "libx264", b_frames=2),
    ),
    (
        Case("h264_bframes.mkv", "H.264 with B-frames in Matroska", "exact", "pts"),
        lambda p: _encode(p, "libx264", b_frames=2),
    ),
    (
        Case("h264_broken_ctts.mp4", "H.264 B-frames in MP4 with lost composition offsets", "exact", "order"),
        lambda p: _encode(p, "libx264", b_frames=2, rewrite=_broken_composition_offsets),
    ),
    (
        Case("h264_rewritten_pts.mkv", "timestamps rewritten to go backwards", "exact", "order"),
        lambda p: _encode(
            p,
            "libx264",
            pts=[512 * i for i in range(FRAMES)],
            time_base=Fraction(1, 12800),
            rewrite=_rewritten_timestamps,
        ),
    ),
    (Case("h264_edit_list.mp4", "an MP4 edit list over a negative start time", "exact", "pts"), _edit_list),
    (Case("vfr_held_frames.avi", "dropped-frame placeholders in AVI", "exact", "pts", "slot", 1 / FPS), _held_frames),
    (Case("vfr_steps.mp4", "variable frame rate with good timestamps", "exact", "pts", "slot", 0.02), _variable_rate),
    (
        Case("h264_10bit.mp4", "10-bit 4:2:0", "exact", "pts"),
        lambda p: _encode(p, "libx264", pix_fmt="yuv420p10le"),
    ),
    (
        Case("h264_444_641x359.mp4", "4:4:4 at an odd frame size", "exact", "pts", size=(641, 359)),
        lambda p: _encode(p, "libx264", pix_fmt="yuv444p", size=(641, 359)),
    ),
    (Case("h264_rotated.mp4", "a 90-degree rotation tag", "exact", "pts", size=(96, 128), rotation=3), _rotated),
    (Case("truncated.avi", "a file cut off after 75% of its bytes", "partial", "pts"), _truncated),
    (Case("corrupt_gop.mp4", "garbage over a GOP in the middle", "damaged", truth="position"), _corrupt_gop),
    (Case("audio_only.mp4", "no video stream", "error", reason="no video stream"), _audio_only),
    (Case("zero_frames.avi", "a video stream without frames", "error", reason="no decodable frames"), _zero_frames),
]
CASES = [case for case, _ in _CASES]
