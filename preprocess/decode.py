"""Decoding clips with PyAV: read the header, place clips, decode forward once, time the frames, resize.

Clips start on the frame grid, and frame ``i`` of a clip starting at ``t0`` is
the frame on screen at ``t0 + i * stride / fps``: source frame
``round(t0 * fps) + i * stride`` for a constant rate, and the frame a player
shows at that time for a variable one.

Which frame is on screen is decided per video from what decoding returns.
Timestamps are trusted when every frame has one, they rise in output order and
they step at about the frame rate; otherwise (B-frames in AVI, broken
composition offsets, rewritten timestamps) frames are timed by their output
order and the frame rate, and the store records ``timing: order``. Decoding
always runs forward from the first frame, so no seek into a file whose index
or timestamps lie can land on the wrong frame.

A file that decodes short of what its header promises is cut inside what
decodes and marked ``partial``; one with frames lost in mid-stream is marked
``damaged`` and its clips over the loss are dropped. Every clip depends only on
its video and the parameters, so it comes out byte-identical whichever rank
decodes it and in whatever order.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Literal

import av
import numpy as np

from clipforge.base.errors import UserError

from .resize import Resizer


class ClipParamsError(UserError):
    """Clip parameters that cannot work; the message names the parameter."""


class VideoError(UserError):
    """A video that cannot be used; the message is the reason written to errors.jsonl."""


@dataclasses.dataclass(frozen=True)
class ClipParams:
    """How clips are cut from a video; recorded in the store, reused by prediction."""

    clip_frames: int = 16
    """Frames per clip (T)."""
    frame_stride: int = 2
    """Take every n-th frame of the source (ignored when target_fps is set)."""
    target_fps: float | None = None
    """Sample frames at this rate instead of a stride, whatever the source's rate."""
    sampling: Literal["uniform", "dense"] = "uniform"
    """uniform: clips_per_video clips spread over the video; dense: a clip every dense_step_s seconds."""
    clips_per_video: int = 4
    """Clips per video for uniform sampling."""
    dense_step_s: float = 1.0
    """Seconds between clip starts for dense sampling."""
    height: int = 112
    """Output frame height."""
    width: int = 112
    """Output frame width."""
    resize: Literal["short_side_crop", "stretch"] = "short_side_crop"
    """short_side_crop: scale the short side to fit, then crop the centre; stretch: scale to H x W."""
    short_videos: Literal["loop", "skip"] = "loop"
    """A video shorter than one clip: loop it to fill the clip, or skip it."""
    decode_threads: int = 1
    """FFmpeg decoder threads per rank (more helps for large frames when ranks < cores)."""

    @classmethod
    def recorded(cls, params: dict[str, Any]) -> ClipParams:
        """The clip parameters among a store's recorded parameters (which also hold codec and shard sizes)."""
        return cls(**{k: v for k, v in params.items() if k in cls.__dataclass_fields__})

    def check(self) -> ClipParams:
        for name in ("clip_frames", "frame_stride", "clips_per_video", "height", "width", "decode_threads"):
            if getattr(self, name) < 1:
                raise ClipParamsError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.target_fps is not None and self.target_fps <= 0:
            raise ClipParamsError(f"target_fps: must be positive, got {self.target_fps}")
        if self.dense_step_s <= 0:
            raise ClipParamsError(f"dense_step_s: must be positive, got {self.dense_step_s}")
        return self


Timing = Literal["pts", "order"]
# A target time this close (in frame intervals) before a frame's time already shows that frame.
TOLERANCE = 0.25


@dataclasses.dataclass
class VideoClips:
    """The clips of one video, and what decoding it found."""

    fps: float
    duration: float
    """Seconds of the decodable span, which clips are cut from."""
    frames: int
    """Frames actually decoded."""
    clips: np.ndarray
    """``[K, T, H, W, 3]`` uint8 RGB."""
    starts: list[float]
    """Start time of each clip, in seconds from the first decodable frame."""
    status: str = "ok"
    """ok; partial: / damaged: (packed, with a warning); skipped: (no clips)."""
    timing: Timing = "pts"
    """pts: frames timed by their timestamps; order: by output order and the frame rate (timestamps untrustworthy)."""
    promised_frames: int = 0
    """Frames the container's header promised (0: it did not say)."""
    first_time: float = 0.0
    """Time of the first decodable frame on the file's own clock."""
    last_time: float = 0.0
    """Time of the last decodable frame on the file's own clock."""
    repeated_clips: int = 0
    """Clips in which one source frame fills two or more places (a looped short video, a held frame)."""

    @property
    def warning(self) -> bool:
        return self.status.startswith(("partial", "damaged"))

    def record(self) -> dict[str, Any]:
        """What the store keeps about the video (its clips aside)."""
        fields = ("fps", "duration", "frames", "status", "timing", "promised_frames", "first_time", "last_time")
        return {**{k: getattr(self, k) for k in fields}, "repeated_clips": self.repeated_clips}


def decode_clips(path: Path, params: ClipParams, starts: list[float] | None = None) -> VideoClips:
    """Decode the clips ``params`` asks for from one video (or clips at ``starts`` seconds).

    One forward decode from the first frame: every frame's output position is
    then known, whatever its timestamp says, and the same decode measures the
    decodable span. A file that decodes short of its header's promise is
    decoded a second time, with clips placed inside what decodes.
    """
    file = _File(path)

    def forward(targets: list[float]) -> _Decoded:
        return _decode_forward(file.for_a_pass(), path, params, targets, fps)

    try:
        fps, promised_duration, promised_frames = _header(file.container, _video_stream(file.container, path))
        decoded = None
        if promised_duration is None:  # no duration in the header (raw streams, live recordings): measure first
            decoded = forward([])
        duration = decoded.span if decoded else promised_duration
        plan = _plan(params, fps, duration, starts)
        if isinstance(plan, VideoClips):
            return plan
        decoded = forward(plan.targets)
        if starts is None and _falls_short(decoded.span, duration, fps):
            # Shorter than the header says (truncated): cut the clips from what decodes, with one more pass.
            plan = _plan(params, fps, decoded.span, starts)
            if isinstance(plan, VideoClips):
                return dataclasses.replace(plan, **decoded.facts(promised_frames))
            decoded = forward(plan.targets)
        return decoded.clips(plan, params, promised_frames, promised_duration)
    finally:
        file.container.close()


class _File:
    """A video's container: the one its header was read from serves the first pass (opening probes the
    stream, which costs as much as a few percent of decoding a short video); later passes reopen it."""

    def __init__(self, path: Path) -> None:
        self.path, self.container, self.fresh = path, _open(path), True

    def for_a_pass(self):
        if not self.fresh:
            self.container.close()
            self.container = _open(self.path)
        self.fresh = False
        return self.container


@dataclasses.dataclass
class _Plan:
    starts: list[float]
    times: np.ndarray
    """``[K, T]`` seconds from the first frame of every frame of every clip."""
    looped: bool

    @property
    def targets(self) -> list[float]:
        return sorted(set(self.times.ravel().tolist()))


def _plan(params: ClipParams, fps: float, duration: float, starts: list[float] | None) -> _Plan | VideoClips:
    """Clip start times on the frame grid, and the time of every frame of every clip."""
    step = 1.0 / params.target_fps if params.target_fps else params.frame_stride / fps
    span = params.clip_frames * step
    short = duration + 1e-6 < span
    if starts is not None:
        pass
    elif short:
        if params.short_videos == "skip":
            empty = np.zeros((0, params.clip_frames, params.height, params.width, 3), np.uint8)
            reason = f"skipped: {duration:.2f} s is shorter than one clip ({span:.2f} s)"
            return VideoClips(fps, duration, 0, empty, [], status=reason)
        starts = [0.0]
    elif params.sampling == "uniform":
        last = duration - span
        k = params.clips_per_video
        starts = [last / 2] if k == 1 else [last * i / (k - 1) for i in range(k)]
    else:
        starts = list(np.arange(0.0, duration - span + 1e-6, params.dense_step_s))
    # On the frame grid: frame i of a clip is then source frame round(start * fps) + i * stride exactly.
    starts = [round(float(s) * fps) / fps for s in starts]
    times = np.array([[s + i * step for i in range(params.clip_frames)] for s in starts], np.float64)
    if short and duration > 0:
        times = times % duration  # loop a short video to fill the clip
    return _Plan([round(s, 6) for s in starts], times.reshape(len(starts), params.clip_frames), short)


class _Decoded:
    """One decode of a stream from its first frame, keeping the frames ``targets`` need under either timing.

    Which timing holds is only known at the end (a timestamp can go backwards
    at any frame), so both picks are followed; for a file with good timestamps
    they are the same frames, and each is converted once.
    """

    def __init__(self, targets: list[float], fps: float, resizer: Resizer) -> None:
        self.targets, self.fps, self.resizer = targets, fps, resizer
        self.by_order = {min(int(t * fps + TOLERANCE), 1 << 40) for t in targets}
        self.by_pts: list[int] = []
        """Per target: the frame on screen at that time by timestamps, while they are monotonic."""
        self.times: list[float | None] = []
        """Each frame's timestamp on the file's clock (None where it had none), in output order."""
        self.kept: dict[int, np.ndarray] = {}
        self.errors: list[tuple[int, str]] = []
        """(frames decoded before it, reason) of every packet that failed to decode."""
        self.monotonic = True

    def add(self, frame: av.VideoFrame) -> None:
        n = len(self.times)
        t = float(frame.time) if frame.pts is not None else None
        if self.monotonic and (t is None or (n and t <= self.times[-1])):
            self.monotonic = False  # from here on only the output order can time frames
        self.times.append(t)
        if n in self.by_order:
            self._keep(n, frame)
        if self.monotonic and n:
            picked, due = self.by_pts, t - self.times[0] - TOLERANCE / self.fps
            while len(picked) < len(self.targets) and self.targets[len(picked)] < due:
                picked.append(n - 1)  # the previous frame is still on screen at that time
                self._keep(n - 1, self._held)
        self._held = frame

    def finish(self) -> None:
        if not self.times:
            return
        last = len(self.times) - 1
        # A target past the end shows the last frame, by either timing.
        if self.monotonic and len(self.by_pts) < len(self.targets):
            self.by_pts += [last] * (len(self.targets) - len(self.by_pts))
            self._keep(last, self._held)
        if any(n > last for n in self.by_order):
            self._keep(last, self._held)

    def _keep(self, n: int, frame: av.VideoFrame) -> None:
        if n not in self.kept:
            self.kept[n] = self.resizer(frame)

    @functools.cached_property
    def timing(self) -> Timing:
        """pts when every frame has a timestamp, they rise, and they step at about the frame rate (after finish)."""
        if not self.monotonic or len(self.times) < 2:
            return "pts" if self.monotonic else "order"
        steps = np.diff(np.asarray(self.times, np.float64))
        return "pts" if 0.5 / self.fps <= float(np.median(steps)) <= 2.0 / self.fps else "order"

    @property
    def span(self) -> float:
        """Seconds from the first decodable frame to the end of the last one."""
        if not self.times:
            return 0.0
        if self.timing == "pts":
            return self.times[-1] - self.times[0] + 1 / self.fps
        return len(self.times) / self.fps

    def facts(self, promised_frames: int) -> dict[str, Any]:
        first = self.times[0] if self.times and self.times[0] is not None else 0.0
        return {
            "frames": len(self.times),
            "timing": self.timing,
            "promised_frames": promised_frames,
            "first_time": round(first, 6),
            "last_time": round(first + self.span - 1 / self.fps, 6),
            "duration": round(self.span, 6),
        }

    def index(self, times: np.ndarray) -> np.ndarray:
        """The source frame (output position) on screen at each of ``times``."""
        if self.timing == "pts":
            lookup = dict(zip(self.targets, self.by_pts))
            return np.array([[lookup[t] for t in row] for row in times.tolist()], np.int64).reshape(times.shape)
        return np.minimum((times * self.fps + TOLERANCE).astype(np.int64), len(self.times) - 1)

    def unusable(self) -> tuple[float, float] | None:
        """The span (seconds from the first frame) whose frames failed to decode in mid-stream, if any."""
        inside = [n for n, _ in self.errors if 0 < n < len(self.times)]
        if not inside:
            return None
        if self.timing == "order":  # positions after a lost frame are unknown: nothing after it is usable
            return inside[0] / self.fps, float("inf")
        rel = [t - self.times[0] for t in self.times]
        return rel[inside[0] - 1] + TOLERANCE / self.fps, rel[inside[-1]] - TOLERANCE / self.fps

    def clips(self, plan: _Plan, params: ClipParams, promised_frames: int, promised_duration: float) -> VideoClips:
        facts = self.facts(promised_frames)
        index = self.index(plan.times)
        keep = np.ones(len(plan.starts), bool)
        status = "ok"
        gap = self.unusable()
        if gap is not None:
            keep = ~((plan.times > gap[0]) & (plan.times < gap[1])).any(axis=1)
            end = "the end" if gap[1] == float("inf") else f"{gap[1]:.2f} s"
            status = (
                f"damaged: frames from {gap[0]:.2f} s to {end} could not be decoded ({self.errors[0][1]}); "
                f"{int((~keep).sum())} of {len(keep)} clips dropped"
            )
        elif _falls_short(self.span, promised_duration, self.fps):
            promised = promised_frames or round(promised_duration * self.fps)
            status = f"partial: decoded {len(self.times)} of {promised} frames (up to {facts['last_time']:.2f} s)"
        index = index[keep]
        out = np.empty((len(index), params.clip_frames, params.height, params.width, 3), np.uint8)
        for c, row in enumerate(index.tolist()):
            for i, n in enumerate(row):
                out[c, i] = self.kept[n]
        repeated = int(sum(len(set(row)) < params.clip_frames for row in index.tolist()))
        starts = [s for s, k in zip(plan.starts, keep) if k]
        return VideoClips(self.fps, clips=out, starts=starts, status=status, repeated_clips=repeated, **facts)


def _decode_forward(container, path: Path, params: ClipParams, targets: list[float], fps: float) -> _Decoded:
    """Decode every frame from the start; a packet that fails is noted and decoding goes on after it."""
    decoded = _Decoded(targets, fps, Resizer(params.height, params.width, params.resize))
    with container:
        stream = _video_stream(container, path)
        # Exactly decode_threads threads: FFmpeg's default (0) starts one per core in every rank, so N ranks
        # on N cores would run N*N decoder threads and hand every frame between them.
        stream.thread_count = params.decode_threads
        if params.decode_threads > 1:
            stream.thread_type = "AUTO"
        for packet in container.demux(stream):
            try:
                frames = packet.decode()
            except av.error.FFmpegError as exc:
                decoded.errors.append((len(decoded.times), _reason(exc)))
                continue
            for frame in frames:
                decoded.add(frame)
    decoded.finish()
    if not decoded.times:
        why = f" ({decoded.errors[0][1]})" if decoded.errors else ""
        raise VideoError(f"no decodable frames{why}")
    return decoded


def _open(path: Path):
    try:
        return av.open(str(path), metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        raise VideoError(f"cannot open: {_reason(exc)}") from None


def _video_stream(container, path: Path):
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["no streams"]
        raise VideoError(f"no video stream (has {', '.join(kinds)})")
    return container.streams.video[0]


def _falls_short(span: float, promised: float | None, fps: float) -> bool:
    """Whether a decodable span is short of the header's promise by more than its usual slack (2 frames, 1%)."""
    return promised is not None and span < promised - max(2 / fps, 0.01 * promised)


def _header(container, stream) -> tuple[float, float | None, int]:
    """(fps, duration, frames) as the container's header promises them; None where it gives no duration."""
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 25.0
    duration = None
    if stream.duration is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / 1e6
    frames = stream.frames or 0
    if frames and duration is not None and container.format.name == "avi":
        # A truncated AVI's duration comes from what its index still holds; the header's frame count is the promise.
        # (Not for MP4: its sample count includes frames an edit list cuts.)
        duration = max(duration, frames / fps)
    if duration is None and frames:
        duration = frames / fps
    if duration is not None and duration <= 0:
        duration = None
    return fps, duration, frames


def _reason(exc: Exception) -> str:
    text = str(exc).split(":")[0] if isinstance(exc, av.error.FFmpegError) else str(exc)
    return getattr(exc, "strerror", None) or text or type(exc).__name__
