"""A small labelled video corpus made locally, for the demo, tests and benchmarks.

Six classes of a shape that moves right, left, up or down, or a bar that turns
clockwise or counter-clockwise: one frame cannot tell the class, so a model
must use time. Videos are encoded with PyAV at mixed codecs, sizes, lengths
and GOPs; a few deliberately odd files (a rotation tag, no duration, shorter
than a clip) and broken ones can be added.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import av
import numpy as np

CLASSES = ["move_right", "move_left", "move_up", "move_down", "turn_clockwise", "turn_counterclockwise"]

# (codec, container extension, pixel format)
CODECS = [
    ("libx264", "mp4", "yuv420p"),
    ("mpeg4", "avi", "yuv420p"),
    ("libvpx-vp9", "webm", "yuv420p"),
    ("mjpeg", "mkv", "yuvj420p"),
]


@dataclasses.dataclass(frozen=True)
class VideoSpec:
    label: str
    frames: int = 48
    fps: int = 25
    width: int = 96
    height: int = 72
    codec: str = "libx264"
    gop: int = 12
    seed: int = 0
    textured: bool = False
    """A background of still low-frequency waves and a checkered shape, instead of flat colours."""


def render_frames(spec: VideoSpec) -> np.ndarray:
    """The frames of one video, ``[N, H, W, 3]`` uint8 RGB."""
    rng = np.random.default_rng(spec.seed)
    h, w = spec.height, spec.width
    yy, xx = np.mgrid[0:h, 0:w]
    background = rng.integers(0, 60, size=3)
    color = rng.integers(150, 256, size=3)
    size = max(6, min(h, w) // 5)
    start = rng.uniform(0.25, 0.75, size=2)  # (x, y) as fractions of the frame
    speed = rng.uniform(0.6, 1.0) / spec.frames  # a full sweep takes about one video
    angle0 = rng.uniform(0, math.pi)
    ground, cell = np.broadcast_to(background, (h, w, 3)), max(2, size // 2)
    if spec.textured:  # drawn after the flat video's numbers, so a flat video stays the same
        frequency = rng.uniform(1, 4, size=(2, 3)) * 2 * math.pi
        phase = rng.uniform(0, 2 * math.pi, size=(2, 3))
        waves = np.sin(xx[..., None] / w * frequency[0] + phase[0]) + np.sin(
            yy[..., None] / h * frequency[1] + phase[1]
        )
        ground = np.clip(background + 30 + 30 * waves, 0, 255)
    frames = np.empty((spec.frames, h, w, 3), np.uint8)
    for t in range(spec.frames):
        img = np.empty((h, w, 3), np.uint8)
        img[:] = ground
        if spec.label.startswith("move_"):
            dx, dy = {"move_right": (1, 0), "move_left": (-1, 0), "move_up": (0, -1), "move_down": (0, 1)}[spec.label]
            cx = ((start[0] + dx * speed * t) % 1.0) * w
            cy = ((start[1] + dy * speed * t) % 1.0) * h
            mask = (np.abs(xx - cx) < size) & (np.abs(yy - cy) < size)
            if spec.textured:  # a checker board that moves with the shape
                pattern = ((xx - cx) // cell + (yy - cy) // cell) % 2 == 0
        else:
            sign = 1 if spec.label == "turn_clockwise" else -1
            theta = angle0 + sign * 2 * math.pi * t / max(spec.frames, 24)
            cx, cy = w / 2, h / 2
            # Distance from the line through the centre at angle theta, limited to a bar's length.
            along = (xx - cx) * math.cos(theta) + (yy - cy) * math.sin(theta)
            across = -(xx - cx) * math.sin(theta) + (yy - cy) * math.cos(theta)
            mask = (np.abs(across) < size / 3) & (np.abs(along) < min(h, w) * 0.4)
            if spec.textured:  # stripes that turn with the bar
                pattern = along // cell % 2 == 0
        if spec.textured:
            img[mask & pattern], img[mask & ~pattern] = color, color * 6 // 10
        else:
            img[mask] = color
        frames[t] = img
    return frames


def write_video(path: Path, spec: VideoSpec, container_format: str | None = None) -> Path:
    """Encode ``spec`` to ``path`` with PyAV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pix_fmt = "yuvj420p" if spec.codec == "mjpeg" else "yuv420p"
    with av.open(str(path), "w", format=container_format) as out:
        stream = out.add_stream(spec.codec, rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, pix_fmt
        stream.codec_context.gop_size = spec.gop
        if spec.codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for frame in render_frames(spec):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def tag_rotation(path: Path, degrees: int) -> None:
    """Set an mp4's display matrix (the 'rotate' tag) so players turn it by ``degrees`` clockwise.

    FFmpeg's muxer ignores a 'rotate' metadata key nowadays; the matrix in the
    track header is what readers honour, so we write it directly.
    """
    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd")
    if at < 0:
        raise ValueError(f"{path}: no track header to tag")
    version = data[at + 4]
    matrix = at + 4 + 4 + (28 if version == 1 else 20) + 8 + 8
    cos, sin = round(math.cos(math.radians(degrees))), round(math.sin(math.radians(degrees)))
    data[matrix : matrix + 36] = struct.pack(">9i", cos << 16, sin << 16, 0, -sin << 16, cos << 16, 0, 0, 0, 1 << 30)
    path.write_bytes(bytes(data))


def make_corpus(
    root: Path,
    videos_per_class: int = 4,
    frames: tuple[int, int] = (40, 72),
    seed: int = 0,
    classes: list[str] | None = None,
    textured: bool = False,
) -> list[Path]:
    """A class-per-folder corpus under ``root``: codecs, sizes, lengths and GOPs vary by video.

    ``textured``: each video's background and shape carry a pattern (:attr:`VideoSpec.textured`).
    """
    rng = np.random.default_rng(seed)
    paths = []
    for label in classes or CLASSES:
        for i in range(videos_per_class):
            codec, ext, _ = CODECS[len(paths) % len(CODECS)]
            width, height = [(96, 72), (128, 96), (80, 80), (112, 64)][int(rng.integers(4))]
            spec = VideoSpec(
                label=label,
                frames=int(rng.integers(frames[0], frames[1] + 1)),
                fps=int(rng.choice([24, 25, 30])),
                width=width,
                height=height,
                codec=codec,
                gop=int(rng.choice([6, 12, 30])),
                seed=int(rng.integers(1 << 30)),
                textured=textured,
            )
            paths.append(write_video(root / label / f"{label}_{i:03d}.{ext}", spec))
    return paths


def add_broken_files(root: Path, label: str) -> list[Path]:
    """Files that must end in errors.jsonl, never in a crash: each kind of broken video once."""
    folder = root / label
    folder.mkdir(parents=True, exist_ok=True)
    good = write_video(folder / "_source.mp4", VideoSpec(label=label, frames=40))
    data = good.read_bytes()
    good.unlink()
    broken = {
        "zero_bytes.mp4": b"",
        "not_a_video.mp4": b"this is a text file with a video's name\n" * 20,
        "truncated.mp4": data[: len(data) // 3],
        "corrupt.mp4": data[:64] + bytes(np.random.default_rng(1).integers(0, 256, len(data) - 64, dtype=np.uint8)),
    }
    paths = []
    for name, content in broken.items():
        (folder / name).write_bytes(content)
        paths.append(folder / name)
    return paths


def write_store(
    out: Path,
    videos_per_class: int = 4,
    clip_frames: int = 16,
    size: int = 224,
    clips_per_video: int = 2,
    val_every: int = 4,
    seed: int = 0,
    codec: str = "raw",
) -> Path:
    """A clip store of rendered videos, written directly (no video encoding, no MPI): for checks on a bare machine.

    Every ``val_every``-th video of a class and its last go to ``val``, the rest to ``train``. There are no
    source files: the store's clips are all there is to evaluate. ``codec``: raw frames or jpeg.
    """
    from .decode import ClipParams, VideoClips
    from .store_writer import ShardWriter, write_index, write_params, write_videos

    params = ClipParams(
        clip_frames=clip_frames, frame_stride=1, clips_per_video=clips_per_video, height=size, width=size
    )
    write_params(out, {**dataclasses.asdict(params), "codec": codec, "jpeg_quality": 90}, overwrite=True)
    writer = ShardWriter(out, 0, (clip_frames, size, size), codec)
    rng = np.random.default_rng(seed)
    videos = []
    frames = clip_frames * (clips_per_video + 1)
    for label, name in enumerate(CLASSES):
        for i in range(videos_per_class):
            spec = VideoSpec(name, frames=frames, width=size, height=size, seed=int(rng.integers(1 << 30)))
            rendered = render_frames(spec)
            starts = [k * clip_frames for k in range(clips_per_video)]
            clips = np.stack([rendered[s : s + clip_frames] for s in starts])
            times = [s / spec.fps for s in starts]
            info = VideoClips(
                float(spec.fps),
                frames / spec.fps,
                frames,
                clips,
                times,
                promised_frames=frames,
                last_time=(frames - 1) / spec.fps,
            ).record()
            writer.add_video(len(videos), label, clips, times, info)
            split = "val" if i % val_every == val_every - 1 or i == videos_per_class - 1 else "train"
            videos.append({"path": f"{name}/{name}_{i:03d}", "label": label, "split": split, **info})
            videos[-1]["num_clips"] = clips_per_video
    marker = writer.commit()
    write_videos(out, {"root": None, "classes": CLASSES, "videos": videos})
    write_index(out, videos, CLASSES, json.loads((Path(out) / "params.json").read_text()), [marker])
    return Path(out)


def write_sharded_store(
    out: Path, shards: int, clip_frames: int = 2, size: int = 8, codec: str = "raw", videos_per_shard: int = 1
) -> Path:
    """A store of ``shards`` shards of ``videos_per_shard`` one-clip videos of tiny clips, written directly: the
    shape of a corpus packed by thousands of ranks, for scale checks of opening and reading (file opens,
    descriptors, locality), not of pixels."""
    from .decode import ClipParams, VideoClips
    from .store_writer import ShardWriter, write_index, write_params, write_videos

    params = ClipParams(clip_frames=clip_frames, frame_stride=1, clips_per_video=1, height=size, width=size)
    write_params(out, {**dataclasses.asdict(params), "codec": codec, "jpeg_quality": 90}, overwrite=True)
    rng = np.random.default_rng(0)
    videos, markers = [], []
    for n in range(shards):
        writer = ShardWriter(out, n, (clip_frames, size, size), codec)
        for v in range(n * videos_per_shard, (n + 1) * videos_per_shard):
            label = v % len(CLASSES)
            clips = rng.integers(0, 256, (1, clip_frames, size, size, 3), dtype=np.uint8)
            info = VideoClips(25.0, clip_frames / 25, clip_frames, clips, [0.0], promised_frames=clip_frames).record()
            writer.add_video(v, label, clips, [0.0], info)
            videos.append(
                {"path": f"{CLASSES[label]}/{v:06d}", "label": label, "split": "train", "num_clips": 1, **info}
            )
        markers.append(writer.commit())
    write_videos(out, {"root": None, "classes": CLASSES, "videos": videos})
    write_index(out, videos, CLASSES, json.loads((Path(out) / "params.json").read_text()), markers)
    return Path(out)
