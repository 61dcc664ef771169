"""Writing a clip store: shards with their commit markers, the parameters, the video table, the index.

The names inside the files come from :mod:`.store_format`; reading is :class:`.store.ClipStore`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from clipforge.base.files import write_json, write_text

from .jpeg import encode_jpeg
from .store_format import (
    CLASSES,
    CLIP_COLUMNS,
    CLIPS,
    CODEC_ATTR,
    COLUMNS,
    ERRORS_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    NUM_CLIPS_ATTR,
    ORDER,
    PARAMS_ATTR,
    PARAMS_FILE,
    SHARD_DISK,
    SHARD_NAME,
    SHARD_NUM_CLIPS,
    SHARD_OFFSET,
    SHARD_SIZE,
    SHARDS_DIR,
    SPLIT_NAMES,
    SPLITS,
    VERSION_ATTR,
    VIDEO_NUMBERS,
    VIDEO_TABLE,
    VIDEO_TEXT,
    VIDEOS_FILE,
    Codec,
    StoreError,
    open_h5,
    shard_name,
)


class ShardWriter:
    """Appends the clips of whole videos to one shard file; :meth:`commit` makes it part of the store."""

    def __init__(
        self, store: Path, number: int, clip_shape: tuple[int, int, int], codec: Codec, jpeg_quality: int = 90
    ):
        self.store, self.number, self.codec, self.jpeg_quality = Path(store), number, codec, jpeg_quality
        self.final = self.store / SHARDS_DIR / f"{shard_name(number)}.h5"
        self.tmp = self.final.with_suffix(".h5.tmp")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        # No chunk alignment to stripes: shards are single-stripe files (``lfs setstripe -c 1``), so a chunk
        # never spans OSTs and alignment buys nothing but holes (a 221 KB clip in a 1 MiB slot made shards
        # 4.7x their data); unaligned, bytes on disk equal the apparent size.
        self.file = open_h5(self.tmp, "w")
        t, h, w = clip_shape
        if codec == "raw":
            self.clips = self.file.create_dataset(
                CLIPS, shape=(0, t, h, w, 3), maxshape=(None, t, h, w, 3), dtype=np.uint8, chunks=(1, t, h, w, 3)
            )
        else:
            self.clips = self.file.create_dataset(
                CLIPS, shape=(0, t), maxshape=(None, t), dtype=h5py.vlen_dtype(np.uint8), chunks=(1, t)
            )
        self.columns = {
            name: self.file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
            for name, dtype in CLIP_COLUMNS.items()
        }
        self.values: dict[str, list] = {name: [] for name in CLIP_COLUMNS}
        """The columns' values until :meth:`commit` writes them at once (an uncommitted shard is discarded)."""
        self.file.attrs[VERSION_ATTR] = FORMAT_VERSION
        self.file.attrs[CODEC_ATTR] = codec
        self.videos: dict[int, dict[str, Any]] = {}
        self.failed: dict[int, str] = {}
        self.num_clips = 0

    def add_video(
        self, video_id: int, label: int, clips: np.ndarray, starts: list[float], info: dict[str, Any]
    ) -> None:
        n = len(clips)
        lo, hi = self.num_clips, self.num_clips + n
        if n:
            self.clips.resize(hi, axis=0)
            if self.codec == "raw":
                if clips.dtype != np.uint8 or clips.shape[1:] != self.clips.shape[1:]:  # raw bytes: no conversion
                    raise ValueError(f"clips of {clips.dtype} {clips.shape[1:]} in a shard of {self.clips.shape[1:]}")
                # One chunk per clip, its bytes as they are: writing each chunk directly skips HDF5's selection
                # and chunk-cache copies (half the time of a slice assignment for small clips).
                for i, clip in enumerate(np.ascontiguousarray(clips)):
                    self.clips.id.write_direct_chunk((lo + i, 0, 0, 0, 0), clip)
            else:
                self.clips[lo:hi] = encode_jpeg(clips, self.jpeg_quality)
            self.values["labels"] += [label] * n
            self.values["video_ids"] += [video_id] * n
            self.values["clip_index"] += range(n)
            self.values["start_times"] += list(starts)
        self.num_clips = hi
        self.videos[video_id] = {**info, "clips": n}

    def add_failure(self, video_id: int, reason: str) -> None:
        self.failed[video_id] = reason

    @property
    def nbytes(self) -> int:
        return self.file.id.get_filesize()

    def commit(self) -> dict[str, Any]:
        """Flush, rename into place, then write the marker; returns the marker."""
        for name, column in self.columns.items():
            column.resize(self.num_clips, axis=0)
            if self.num_clips:
                column[:] = np.asarray(self.values[name], dtype=CLIP_COLUMNS[name])
        self.file.attrs[NUM_CLIPS_ATTR] = self.num_clips
        self.file.flush()
        self.file.close()
        os.replace(self.tmp, self.final)
        stat = self.final.stat()
        marker = {
            "shard": self.final.name,
            "number": self.number,
            "num_clips": self.num_clips,
            "size": stat.st_size,
            "disk": stat.st_blocks * 512,
            "videos": {str(k): v for k, v in self.videos.items()},
            "failed": {str(k): v for k, v in self.failed.items()},
        }
        write_json(self.final.with_suffix(".json"), marker, sort_keys=True)
        return marker

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def committed_markers(store: Path) -> list[dict[str, Any]]:
    """Markers of the shards that finished, in shard-number order; half-written shards are removed."""
    shards = Path(store) / SHARDS_DIR
    if not shards.is_dir():
        return []
    for stale in shards.glob("*.h5.tmp"):
        stale.unlink()
    markers = []
    for path in sorted(shards.glob("shard-*.json")):
        marker = json.loads(path.read_text())
        if (shards / marker["shard"]).exists():
            markers.append(marker)
        else:
            path.unlink()  # a marker without its shard: the shard was lost, redo its videos
    return markers


def write_params(store: Path, params: dict[str, Any], overwrite: bool) -> None:
    """Record the parameters before anything is written; refuse to mix parameters in one store."""
    path = Path(store) / PARAMS_FILE
    if path.exists():
        if not overwrite:
            check_params(store, params)
        if json.loads(path.read_text()) != params:
            remove_store(store)
    Path(store).mkdir(parents=True, exist_ok=True)
    write_json(path, params, sort_keys=True)


def check_params(store: Path, params: dict[str, Any]) -> None:
    """Refuse to pack ``params`` into a store that was packed with others."""
    path = Path(store) / PARAMS_FILE
    if not path.exists():
        return
    old = json.loads(path.read_text())
    if old != params:
        changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
        raise StoreError(
            f"{store} was packed with other parameters ({', '.join(changed)} differ); "
            "pack into a new directory, or pass --overwrite to rebuild it"
        )


def remove_store(store: Path) -> None:
    store = Path(store)
    for pattern in (f"{SHARDS_DIR}/shard-*", INDEX_FILE, ERRORS_FILE, PARAMS_FILE, VIDEOS_FILE):
        for path in store.glob(pattern):
            path.unlink()


def write_index(
    store: Path,
    videos: list[dict[str, Any]],
    classes: list[str],
    params: dict[str, Any],
    markers: list[dict[str, Any]],
) -> Path:
    """Write ``index.h5`` (under a temporary name, then renamed) from the committed shards.

    ``videos`` is the video table in id order: path, label (index), split, and
    what decoding found (the columns of VIDEO_TEXT and VIDEO_NUMBERS).
    """
    store = Path(store)
    counts = [m["num_clips"] for m in markers]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(offsets[-1])
    tmp = store / f"{INDEX_FILE}.tmp"
    with open_h5(tmp, "w") as f:
        f.attrs[VERSION_ATTR] = FORMAT_VERSION
        f.attrs[PARAMS_ATTR] = json.dumps(params, sort_keys=True)
        f.attrs[NUM_CLIPS_ATTR] = total
        f.create_dataset(CLASSES, data=np.array(classes, dtype=object), dtype=h5py.string_dtype())
        table = f.create_group(VIDEO_TABLE)
        for key in VIDEO_TEXT:
            table.create_dataset(key, data=np.array([v[key] for v in videos], dtype=object), dtype=h5py.string_dtype())
        for key, dtype in VIDEO_NUMBERS.items():
            table.create_dataset(key, data=np.array([v[key] for v in videos], dtype=dtype))
        names = np.array([m["shard"] for m in markers], dtype=object)
        f.create_dataset(SHARD_NAME, data=names, dtype=h5py.string_dtype())
        f.create_dataset(SHARD_SIZE, data=np.array([m["size"] for m in markers], dtype=np.int64))
        f.create_dataset(SHARD_NUM_CLIPS, data=np.array(counts, dtype=np.int64))
        f.create_dataset(SHARD_OFFSET, data=offsets[:-1])
        f.create_dataset(SHARD_DISK, data=np.array([m.get("disk", m["size"]) for m in markers], dtype=np.int64))
        # Real copies of the small per-clip columns, so that opening the store reads this file alone; the
        # virtual datasets beside them are for outside tools (h5ls, h5dump), and reading one opens every shard.
        columns = {name: np.empty(total, dtype) for name, dtype in CLIP_COLUMNS.items()}
        layouts: dict[str, h5py.VirtualLayout] = {}
        for m, lo in zip(markers, offsets):
            if not m["num_clips"]:
                continue
            with open_h5(store / SHARDS_DIR / m["shard"], "r") as shard:
                for name in (CLIPS, *CLIP_COLUMNS):
                    ds = shard[name]
                    if name not in layouts:
                        layouts[name] = h5py.VirtualLayout(shape=(total, *ds.shape[1:]), dtype=ds.dtype)
                    layouts[name][lo : lo + m["num_clips"]] = h5py.VirtualSource(
                        f"{SHARDS_DIR}/{m['shard']}", name, shape=ds.shape
                    )
                    if name in columns:
                        columns[name][lo : lo + m["num_clips"]] = ds[:]
        for name, layout in layouts.items():
            f.create_virtual_dataset(name, layout)
        for name, values in columns.items():
            f.create_dataset(f"{COLUMNS}/{name}", data=values)
        video_ids, clip_index = columns["video_ids"], columns["clip_index"]
        # Index order: by video, then by clip, whichever rank wrote what.
        order = np.lexsort((clip_index, video_ids)) if total else np.zeros(0, np.int64)
        f.create_dataset(ORDER, data=order.astype(np.int64))
        split_of_video = np.array([v["split"] for v in videos], dtype=object)
        splits = f.create_group(SPLITS)
        for split in SPLIT_NAMES:
            chosen = order[split_of_video[video_ids[order]] == split] if total else order
            splits.create_dataset(split, data=chosen.astype(np.int64))
    os.replace(tmp, store / INDEX_FILE)
    return store / INDEX_FILE


def write_errors(store: Path, errors: list[dict[str, Any]]) -> None:
    write_text(Path(store) / ERRORS_FILE, "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors))


def write_videos(store: Path, table: dict[str, Any]) -> None:
    """The scanned video table (ids are positions in it), kept for reruns."""
    write_text(Path(store) / VIDEOS_FILE, json.dumps(table))
