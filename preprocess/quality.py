"""What a packed store holds, video by video: ``clipforge store inspect STORE``.

It reads ``index.h5`` alone (no shard is opened), so it costs the same for a
store of ten thousand shards as for one of ten.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

from .store import ClipStore


@dataclasses.dataclass(frozen=True)
class VideoQuality:
    path: str
    status: str
    timing: str
    """pts or order; empty for a video without clips."""
    frames: int
    promised_frames: int
    first_time: float
    last_time: float
    clips: int
    repeated_clips: int

    @property
    def look(self) -> str:
        """Why a person should look at this video; empty when nothing is odd."""
        reasons = []
        if self.status != "ok":
            reasons.append(self.status.split(":")[0])
        if self.timing == "order":
            reasons.append("timestamps untrustworthy, timed by frame order")
        if self.repeated_clips:
            reasons.append(f"{self.repeated_clips} of {self.clips} clips repeat a frame")
        return "; ".join(reasons)


@dataclasses.dataclass(frozen=True)
class StoreReport:
    root: Path
    codec: str
    clip_shape: tuple[int, int, int]
    videos: list[VideoQuality]
    shards: int = 0
    bytes: int = 0
    """Apparent size of the shards."""
    disk: int = 0
    """What the shards take on disk."""

    @property
    def clips(self) -> int:
        return sum(v.clips for v in self.videos)

    def summary(self) -> dict[str, Any]:
        repeated = sum(v.repeated_clips for v in self.videos)
        return {
            "store": str(self.root),
            "videos": len(self.videos),
            "clips": self.clips,
            "codec": self.codec,
            "clip_shape": list(self.clip_shape),
            "status": dict(Counter(v.status.split(":")[0] for v in self.videos)),
            "timing": dict(Counter(v.timing for v in self.videos if v.timing)),
            "repeated_clips": repeated,
            "repeated_share": round(repeated / self.clips, 4) if self.clips else 0.0,
            "worth_a_look": sum(1 for v in self.videos if v.look),
            "shards": self.shards,
            "bytes": self.bytes,
            "bytes_on_disk": self.disk,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "per_video": [{**dataclasses.asdict(v), "look": v.look} for v in self.videos],
        }

    def lines(self, every_video: bool = False) -> list[str]:
        s = self.summary()
        t, h, w = self.clip_shape
        out = [
            f"{self.root}: {s['videos']} videos, {s['clips']} clips of {t}x{h}x{w} ({self.codec})",
            "  status: " + ", ".join(f"{n} {k}" for k, n in sorted(s["status"].items())),
            "  timing: " + (", ".join(f"{n} by {k}" for k, n in sorted(s["timing"].items())) or "not recorded"),
            f"  clips with a repeated frame: {s['repeated_clips']} of {s['clips']} ({100 * s['repeated_share']:.1f}%)",
            f"  {self.shards} shards, {self.bytes / 2**20:.1f} MiB ({self.disk / 2**20:.1f} MiB on disk)",
        ]
        shown = self.videos if every_video else [v for v in self.videos if v.look]
        if not shown:
            out.append("nothing worth a look")
            return out
        out.append(f"{'videos' if every_video else 'worth a look'} ({len(shown)}):")
        out.append(f"  {'TIMING':<6} {'FRAMES':>11} {'SPAN (s)':>13} {'CLIPS':>5}  PATH  (WHY)")
        for v in shown:
            frames = f"{v.frames}/{v.promised_frames}" if v.promised_frames else str(v.frames)
            span = f"{v.first_time:.2f}-{v.last_time:.2f}" if v.frames else "-"
            why = v.look or "ok"
            detail = f": {v.status.split(':', 1)[1].strip()}" if ":" in v.status else ""
            out.append(f"  {v.timing or '-':<6} {frames:>11} {span:>13} {v.clips:>5}  {v.path}  ({why}{detail})")
        return out


def inspect_store(root: Path) -> StoreReport:
    store = ClipStore.open(root)
    table = store.videos

    names = ("path", "status", "timing", "frames", "promised_frames", "first_time", "last_time", "num_clips")
    rows = zip(*(list(table[name]) for name in (*names, "repeated_clips")))
    videos = [
        VideoQuality(p, s, t, int(f), int(pf), float(a), float(b), int(c), int(r))
        for p, s, t, f, pf, a, b, c, r in rows
    ]
    params = store.params
    shape = (int(params["clip_frames"]), int(params["height"]), int(params["width"]))
    store.close()
    sizes = (len(store.shard_names), int(store.shard_sizes.sum()), int(store.shard_disk.sum()))
    return StoreReport(Path(root), store.codec, shape, videos, *sizes)
