"""Batch prediction over a manifest of videos: one JSON line per video, resumable where it stopped.

Every rank appends to its own part file next to the output
(``predictions.jsonl.parts/rank-00003.jsonl``), a line per video, flushed as
it is written, so a killed job loses at most the line being written (cut off
and redone on the next run). A run first reads every line already there (the
output and all parts, whatever world size wrote them) and skips those videos;
at the end rank 0 appends the parts to the output, each video once, and
removes them. A video that cannot be decoded gets a line with its ``error``:
it is not retried on a rerun (start a new output to retry it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from clipforge.base.errors import UserError

from .evaluation import softmax

log = logging.getLogger(__name__)


class PredictionError(UserError):
    """Some videos of a prediction job could not be classified (the others were)."""


class ManifestError(UserError):
    """A manifest of videos that cannot be read; the message names the file."""


def read_manifest(path: Path) -> list[Path]:
    """Video paths, one per line; blank lines and lines starting with ``#`` are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(
            f"{path}: cannot read the manifest ({exc.__class__.__name__}); give a text file of video paths"
        ) from None
    return [Path(s) for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def top_classes(logits: np.ndarray, classes: list[str], top: int) -> list[dict[str, Any]]:
    """The ``top`` classes of a video from the logits of its views (their softmax averaged)."""
    probs = softmax(logits.astype(np.float64)).mean(axis=0)
    best = np.argsort(-probs)[:top]
    return [{"class": classes[i], "probability": round(float(probs[i]), 6)} for i in best]


class PredictionLog:
    """The JSONL output of a prediction job and the part files its ranks write before it is complete."""

    def __init__(self, out: Path, rank: int = 0) -> None:
        self.out = Path(out)
        self.parts = self.out.parent / f"{self.out.name}.parts"
        self.rank = rank
        self._file = None

    def done(self) -> set[str]:
        """The videos that already have a line, in the output or in any rank's part file."""
        return {record["video"] for record in self._records([self.out, *self._part_files()])}

    def failed(self) -> set[str]:
        """The videos whose line says they could not be classified."""
        return {r["video"] for r in self._records([self.out, *self._part_files()]) if r.get("error") is not None}

    def append(self, record: dict[str, Any]) -> None:
        """One video's line, flushed at once (a kill loses at most this line)."""
        if self._file is None:
            self.parts.mkdir(parents=True, exist_ok=True)
            path = self.parts / f"rank-{self.rank:05d}.jsonl"
            _cut_partial_line(path)
            self._file = open(path, "a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def merge(self) -> int:
        """Append the parts' lines to the output, each video once, then remove the parts (rank 0, at the end)."""
        self.close()
        _cut_partial_line(self.out)
        seen = {r["video"] for r in self._records([self.out])}
        added = 0
        with open(self.out, "a", encoding="utf-8") as f:
            for record in self._records(self._part_files()):
                if record["video"] not in seen:
                    seen.add(record["video"])
                    f.write(json.dumps(record) + "\n")
                    added += 1
            f.flush()
            os.fsync(f.fileno())
        for part in self._part_files():
            part.unlink()
        if self.parts.is_dir():
            self.parts.rmdir()
        return added

    def _part_files(self) -> list[Path]:
        return sorted(self.parts.glob("rank-*.jsonl")) if self.parts.is_dir() else []

    @staticmethod
    def _records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
        for path in paths:
            if not path.exists():
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the line a kill cut short: its video is predicted again
                    if isinstance(record, dict) and "video" in record:
                        yield record


def _cut_partial_line(path: Path) -> None:
    """Drop a last line without its newline (a write cut short by a kill), so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        data_end = f.seek(0, os.SEEK_END)
        step = min(data_end, 1 << 16)
        while True:
            f.seek(data_end - step)
            chunk = f.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(data_end - step + cut + 1)
                return
            if step == data_end:
                f.truncate(0)
                return
            step = min(data_end, step * 2)
