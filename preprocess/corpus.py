"""Scanning a corpus: a class-per-folder tree or a manifest, into a deterministic video table.

The scan never drops a file silently: every file it does not take is reported
with the reason (``Corpus.skipped``), and problems that make the corpus
ambiguous (duplicates, labels with path separators, paths outside the root)
stop it with one line naming the entry.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import stat
from collections import defaultdict
from pathlib import Path

import numpy as np

from clipforge.base.errors import UserError

VIDEO_EXTENSIONS = frozenset(
    {
        ".mp4",
        ".m4v",
        ".mov",
        ".avi",
        ".mkv",
        ".webm",
        ".mpg",
        ".mpeg",
        ".ts",
        ".flv",
        ".wmv",
        ".3gp",
        ".ogv",
        ".h264",
        ".264",
    }
)
SPLITS = ("train", "val", "test")


class CorpusError(UserError):
    """A corpus that cannot be scanned as given; the message names the entry and the fix."""


@dataclasses.dataclass(frozen=True)
class Video:
    path: str
    """Path relative to the corpus root (as written in the index)."""
    label: str
    split: str


@dataclasses.dataclass
class Corpus:
    root: Path
    videos: list[Video]
    """Sorted by (label, path): the same corpus always gives the same table and video ids."""
    classes: list[str]
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path, reason) for every file the scan saw and did not take."""
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes of each video, by path (the packing plan does the longest first)."""

    def label_index(self, video: Video) -> int:
        return self.classes.index(video.label)

    def absolute(self, video: Video) -> Path:
        return self.root / video.path


@dataclasses.dataclass(frozen=True)
class SplitRatios:
    """How videos without a given split are divided, stratified by class."""

    train: float = 0.8
    """Share of each class's videos for training."""
    val: float = 0.1
    """Share for validation."""
    test: float = 0.1
    """Share for testing."""
    seed: int = 0
    """Seed of the split: the same seed always gives the same split."""

    def __post_init__(self) -> None:
        if min(self.train, self.val, self.test) < 0 or abs(self.train + self.val + self.test - 1) > 1e-6:
            raise CorpusError(f"split ratios {self.train}/{self.val}/{self.test} must be non-negative and sum to 1")


@dataclasses.dataclass
class Listing:
    """What a corpus lists, before any file is looked at: entries (path, label, split or None) and skips."""

    source: Path
    root: Path
    entries: list[tuple[str, str, str | None]]
    skipped: list[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class PathCheck:
    """What one stat-like look at a listed path found: its key under the root, a problem, its size."""

    key: str | None
    """The path relative to the real root, or None when it resolves outside the root."""
    problem: str | None
    size: int = 0


def scan(source: Path, ratios: SplitRatios = SplitRatios()) -> Corpus:
    """Scan a class-per-folder tree (``root/<class>/<video>``) or a CSV/JSONL manifest, in this process.

    The packing job does the same in three steps so that its ranks share the looking:
    :func:`list_corpus` on one rank, :func:`check_paths` on every rank for its share of
    the paths, :func:`assemble` on the first again.
    """
    listing = list_corpus(source)
    return assemble(listing, check_paths(listing.root, [rel for rel, _, _ in listing.entries]), ratios)


def probe_corpus(source: Path, paths: int = 5) -> None:
    """Refuse, in seconds, a corpus that cannot be packed: missing, empty, or a manifest that fails to parse
    or whose first ``paths`` entries all cannot be packed. A tree is read only until its first video.
    """
    source = Path(source)
    if source.is_dir():
        classes = 0
        with os.scandir(source) as top:
            for entry in sorted(top, key=lambda e: e.name):
                if not entry.is_dir(follow_symlinks=False):
                    continue
                classes += 1
                with os.scandir(entry.path) as inside:
                    if any(Path(f.name).suffix.lower() in VIDEO_EXTENSIONS for f in inside):
                        return
        where = f"its {classes} class folders" if classes else "it (it has no class folders)"
        raise CorpusError(
            f"{source}: no videos in {where}; a corpus folder is laid out as <root>/<class>/<video> "
            f"(extensions taken: {', '.join(sorted(VIDEO_EXTENSIONS))}), or give a .csv/.jsonl manifest"
        )
    listing = list_corpus(source)  # a missing path or a manifest that does not parse says so here
    if not listing.entries:
        raise CorpusError(f"{source}: the manifest lists no videos; add lines of path,label[,split]")
    first = [rel for rel, _, _ in listing.entries[:paths]]
    checks = check_paths(listing.root, first)
    if all(c.problem for c in checks):
        raise CorpusError(
            f"{source}: none of its first {len(first)} videos can be packed ({first[0]}: {checks[0].problem}); "
            f"manifest paths are relative to the manifest's folder {listing.root.resolve()}"
        )


def list_corpus(source: Path) -> Listing:
    """Walk the tree (directory reads only, no stat per file) or parse the manifest."""
    source = Path(source)
    if not source.exists():
        raise CorpusError(f"{source} does not exist; give a corpus folder or a .csv/.jsonl manifest")
    if source.is_dir():
        root, entries, skipped = source, *_scan_tree(source)
    elif source.suffix.lower() in (".csv", ".jsonl"):
        root, entries, skipped = source.parent, *_read_manifest(source)
    else:
        raise CorpusError(f"{source}: a corpus is a folder of class folders or a .csv/.jsonl manifest")
    for rel, label, _ in entries:
        if not label or "/" in label or "\\" in label or label in (".", ".."):
            raise CorpusError(f"{rel}: label {label!r} must be a plain name without path separators")
    return Listing(source, root, entries, skipped)


def check_paths(root: Path, rels: list[str]) -> list[PathCheck]:
    """Resolve, stat and check each listed path (the metadata work a million-file corpus is made of)."""
    real_root = Path(root).resolve()
    checks = []
    for rel in rels:
        target = (Path(root) / rel).resolve()
        # A manifest path must stay inside the corpus root: no '..', no absolute paths elsewhere, no symlinks out.
        if not target.is_relative_to(real_root):
            checks.append(PathCheck(None, f"resolves to {target}, outside the corpus root {real_root}; move it inside"))
            continue
        key = target.relative_to(real_root).as_posix()
        if Path(rel).suffix.lower() not in VIDEO_EXTENSIONS:
            checks.append(PathCheck(key, f"extension {Path(rel).suffix or '(none)'} is not a video extension"))
            continue
        try:
            st = target.stat()
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            checks.append(PathCheck(key, "does not exist or is not a file"))
        elif not os.access(target, os.R_OK):
            checks.append(PathCheck(key, "is not readable"))
        else:
            checks.append(PathCheck(key, None, st.st_size))
    return checks


def assemble(listing: Listing, checks: list[PathCheck], ratios: SplitRatios = SplitRatios()) -> Corpus:
    """The corpus from its listing and the checks of its paths (in listing order)."""
    seen: dict[str, str] = {}
    kept, skipped, sizes = [], list(listing.skipped), {}
    for (rel, label, split), check in zip(listing.entries, checks, strict=True):
        if check.key is None:
            raise CorpusError(f"{rel}: {check.problem}")
        if check.key in seen:
            raise CorpusError(f"{rel}: listed twice (labels {seen[check.key]!r} and {label!r}); keep one entry")
        seen[check.key] = label
        if check.problem:
            skipped.append((check.key, check.problem))
        else:
            kept.append((check.key, label, split))
            sizes[check.key] = check.size
    kept.sort(key=lambda e: (e[1], e[0]))
    if not kept:
        raise CorpusError(
            f"{listing.source}: no videos found (extensions taken: {', '.join(sorted(VIDEO_EXTENSIONS))})"
        )
    classes = sorted({label for _, label, _ in kept})
    videos = _assign_splits(kept, ratios)
    return Corpus(root=listing.root.resolve(), videos=videos, classes=classes, skipped=skipped, sizes=sizes)


def _utf8(name: str) -> bool:
    """Whether ``name`` is text: os.walk gives a name that is not valid UTF-8 (a Latin-1 name from an old archive)
    as surrogate escapes, which nothing that writes text can encode."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _scan_tree(root: Path) -> tuple[list[tuple[str, str, str | None]], list[tuple[str, str]]]:
    entries: list[tuple[str, str, str | None]] = []
    skipped: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if not _utf8(rel):  # the store's index, videos.json and the ranks' work list hold names as UTF-8
                printable = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                skipped.append((printable, "its name is not valid UTF-8; rename it (e.g. convmv -f latin1 -t utf-8)"))
            elif len(rel_dir.parts) != 1:
                skipped.append((rel, "not inside a class folder (expected root/<class>/<video>)"))
            elif Path(name).suffix.lower() not in VIDEO_EXTENSIONS:
                skipped.append((rel, f"extension {Path(name).suffix or '(none)'} is not a video extension"))
            else:
                entries.append((rel, rel_dir.parts[0], None))
    return entries, skipped


def _read_manifest(path: Path) -> tuple[list[tuple[str, str, str | None]], list[tuple[str, str]]]:
    rows: list[dict] = []
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"path", "label"} - set(reader.fieldnames or [])
            if missing:
                raise CorpusError(
                    f"{path}: the header needs columns path,label[,split]; missing {', '.join(sorted(missing))}"
                )
            rows = list(reader)
    else:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{n}: not a JSON object ({exc.msg})") from None
            if not isinstance(row, dict) or "path" not in row or "label" not in row:
                raise CorpusError(f'{path}:{n}: each line needs "path" and "label"')
            rows.append(row)
    entries = []
    for n, row in enumerate(rows, 1):
        split = (row.get("split") or None) if isinstance(row.get("split"), str) else None
        if split is not None and split not in SPLITS:
            raise CorpusError(f"{path}: entry {n} ({row['path']}): split {split!r} is not one of {', '.join(SPLITS)}")
        entries.append((str(row["path"]), str(row["label"]), split))
    return entries, []


def _assign_splits(entries: list[tuple[str, str, str | None]], ratios: SplitRatios) -> list[Video]:
    """Given splits are kept; the rest get a seeded split stratified by class."""
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, (_, label, split) in enumerate(entries):
        if split is None:
            by_class[label].append(i)
    splits: list[str | None] = [split for _, _, split in entries]
    rng = np.random.default_rng(ratios.seed)
    for label in sorted(by_class):
        idx = by_class[label]
        order = rng.permutation(len(idx))
        n_val = int(round(len(idx) * ratios.val))
        n_test = int(round(len(idx) * ratios.test))
        if len(idx) - n_val - n_test < 1 and ratios.train > 0:
            n_val, n_test = min(n_val, max(0, len(idx) - 1)), 0
        for rank, j in enumerate(order):
            splits[idx[j]] = "val" if rank < n_val else "test" if rank < n_val + n_test else "train"
    return [Video(path, label, split or "train") for (path, label, _), split in zip(entries, splits)]
