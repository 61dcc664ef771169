"""A packed clip store, opened for reading: :class:`ClipStore`.

Opening reads ``index.h5`` alone; shards are opened on first use, once per process. The names inside
the files come from :mod:`.store_format`; writing is :mod:`.store_writer`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from clipforge.base.files import sha256

from .jpeg import decode_jpeg
from .store_format import (
    CLASSES,
    CLIP_COLUMNS,
    CLIPS,
    COLUMNS,
    ERRORS_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    NUM_CLIPS_ATTR,
    ORDER,
    PARAMS_ATTR,
    SHARD_DISK,
    SHARD_NAME,
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
)

# Shard handles one process keeps open (least recently used closed first): well under a 1,024 fd limit
# divided by the DataLoader workers of a rank.
MAX_OPEN_SHARDS = 64


@dataclasses.dataclass
class ClipStore:
    """A packed store, opened for reading. Shard files are opened lazily, once per process.

    A handle opened before a DataLoader forks gives wrong data in the workers
    (pytorch #11887), so handles are keyed by process id and opened on first use.
    """

    root: Path
    classes: list[str]
    params: dict[str, Any]
    codec: Codec
    labels: np.ndarray
    video_ids: np.ndarray
    clip_index: np.ndarray
    start_times: np.ndarray
    order: np.ndarray
    splits: dict[str, np.ndarray]
    videos: dict[str, np.ndarray]
    shard_names: list[str]
    shard_offsets: np.ndarray
    shard_sizes: np.ndarray
    """Apparent bytes of each shard, as committed."""
    shard_disk: np.ndarray
    """Bytes on disk of each shard, as committed."""
    max_open_shards: int = MAX_OPEN_SHARDS
    opened: int = 0
    """Shard opens by this process so far (a reopen after an eviction counts again)."""
    _handles: dict[tuple[int, int], h5py.File] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path, max_open_shards: int = MAX_OPEN_SHARDS) -> ClipStore:
        """Read ``index.h5`` and nothing else: no shard is opened or even looked at until a clip is read."""
        root = Path(root)
        index = root / INDEX_FILE
        if not index.exists():
            raise StoreError(f"{root} has no index.h5: it is not a clip store, or its packing job has not finished")
        with open_h5(index, "r") as f:
            if f.attrs.get(VERSION_ATTR) != FORMAT_VERSION:
                raise StoreError(
                    f"{index}: format version {f.attrs.get(VERSION_ATTR)} is not {FORMAT_VERSION}; repack it"
                )
            lacking = [
                name
                for name in (COLUMNS, *(f"{VIDEO_TABLE}/{k}" for k in (*VIDEO_TEXT, *VIDEO_NUMBERS)))
                if name not in f
            ]
            if lacking:
                raise StoreError(
                    f"{index}: no {lacking[0]}: the store was packed by a development version of clipforge; repack it "
                    "(jobs/preprocess.py --overwrite)"
                )
            params = json.loads(f.attrs[PARAMS_ATTR])
            total = int(f.attrs[NUM_CLIPS_ATTR])
            columns = {k: (f[COLUMNS][k][:] if total else np.zeros(0)) for k in CLIP_COLUMNS}
            videos = {k: f[VIDEO_TABLE][k][:] for k in f[VIDEO_TABLE]}
            for k in VIDEO_TEXT:
                videos[k] = np.array([x.decode() if isinstance(x, bytes) else x for x in videos[k]], dtype=object)
            return cls(
                root=root,
                classes=[c.decode() if isinstance(c, bytes) else c for c in f[CLASSES][:]],
                params=params,
                codec=params["codec"],
                labels=columns["labels"].astype(np.int64),
                video_ids=columns["video_ids"].astype(np.int64),
                clip_index=columns["clip_index"].astype(np.int64),
                start_times=columns["start_times"].astype(np.float64),
                order=f[ORDER][:],
                splits={s: f[SPLITS][s][:] for s in SPLIT_NAMES},
                videos=videos,
                shard_names=[n.decode() if isinstance(n, bytes) else n for n in f[SHARD_NAME][:]],
                shard_offsets=f[SHARD_OFFSET][:],
                shard_sizes=f[SHARD_SIZE][:],
                shard_disk=f[SHARD_DISK][:] if SHARD_DISK in f else f[SHARD_SIZE][:],
                max_open_shards=max_open_shards,
            )

    def verify(self) -> None:
        """Check that every shard is there with the size the index recorded (``clipforge store verify``)."""
        for s in range(len(self.shard_names)):
            self._check_shard(s)

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data a model saw: format version, index checksum, classes, clip parameters."""
        return {
            "format_version": FORMAT_VERSION,
            "index_sha256": sha256(self.root / INDEX_FILE),
            "classes": list(self.classes),
            "params": self.params,
        }

    def source_paths(self, video_ids: Iterable[int], root: Path | None = None) -> list[Path]:
        """Where the source files of ``video_ids`` are: under ``root``, or the corpus root the store was packed from."""
        if root is None:
            table = self.root / VIDEOS_FILE
            try:
                root = Path(json.loads(table.read_text())["root"])
            except (OSError, ValueError, KeyError, TypeError):  # TypeError: a store with no source files
                raise StoreError(
                    f"{table} cannot be read, so the source videos of {self.root} are unknown; "
                    "name their folder (--videos-root) or take the clips from the store"
                ) from None
        return [root / self.videos["path"][int(v)] for v in video_ids]

    def shard_of(self, positions: np.ndarray) -> np.ndarray:
        """The shard number of each store position."""
        return np.searchsorted(self.shard_offsets, positions, side="right") - 1

    def read_clip(self, position: int) -> np.ndarray:
        """The clip at ``position``, ``[T, H, W, 3]`` uint8.

        ``position`` is a position in the store, as in ``order`` and ``splits``.
        """
        s = int(self.shard_of(position))
        clips = self._shard(s)[CLIPS]
        local = int(position - self.shard_offsets[s])
        if self.codec == "raw":
            return read_chunk(clips, local)
        return decode_jpeg(clips[local])

    def read_encoded(self, position: int) -> list[np.ndarray]:
        """The JPEG bytes of each frame of the clip at ``position`` (jpeg stores), to decode elsewhere."""
        if self.codec != "jpeg":
            raise StoreError(f"{self.root} holds {self.codec} clips; only a jpeg store has frames to decode later")
        s = int(self.shard_of(position))
        return list(self._shard(s)[CLIPS][int(position - self.shard_offsets[s])])

    def _shard(self, s: int) -> h5py.File:
        """Shard ``s`` opened in this process; at most ``max_open_shards`` stay open (least recently used go)."""
        key = (os.getpid(), s)
        handle = self._handles.pop(key, None)
        if handle is None:
            self._check_shard(s)
            handle = open_h5(self.root / SHARDS_DIR / self.shard_names[s], "r")
            self.opened += 1
            mine = [k for k in self._handles if k[0] == key[0]]
            for old in mine[: max(0, len(mine) + 1 - self.max_open_shards)]:
                self._handles.pop(old).close()
        self._handles[key] = handle  # most recently used last (dicts keep insertion order)
        return handle

    def _check_shard(self, s: int) -> None:
        """An HDF5 file cut short reads garbage or fails deep inside h5py; refuse it with its name instead."""
        path = self.root / SHARDS_DIR / self.shard_names[s]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreError(
                f"{path} is missing from the store; rerun the packing job on {self.root} to rebuild it"
            ) from None
        if size != int(self.shard_sizes[s]):
            raise StoreError(
                f"{path} is {size} bytes but the index says {int(self.shard_sizes[s])} (truncated or replaced); "
                f"rerun the packing job on {self.root} with --overwrite"
            )

    def close(self) -> None:
        for key, handle in list(self._handles.items()):
            if key[0] == os.getpid():
                handle.close()
            del self._handles[key]

    def __getstate__(self) -> dict[str, Any]:
        # Open HDF5 handles never cross a fork or a pickle: each process opens its own.
        state = dict(self.__dict__)
        state["_handles"], state["opened"] = {}, 0
        return state


def read_chunk(clips: h5py.Dataset, i: int) -> np.ndarray:
    """Raw clip ``i`` (one clip per chunk, unfiltered): the chunk's bytes as they lie in the file.

    ``read_direct_chunk`` skips HDF5's selection machinery and its chunk cache (which would copy each clip
    twice, and whose 1 MiB default is smaller than a 224x224 clip): 1.5-2x ``clips[i]`` at 112 and 224 px.
    """
    if clips.compression is not None or clips.chunks != (1, *clips.shape[1:]):
        return clips[i]  # a layout this writer does not make: let HDF5 assemble it
    out = np.empty(clips.shape[1:], np.uint8)
    clips.id.read_direct_chunk((i,) + (0,) * (clips.ndim - 1), out=out.reshape(-1))
    return out


def read_errors(store: Path) -> list[dict[str, Any]]:
    """Every video that failed or was skipped, and why (empty before the first pack)."""
    path = Path(store) / ERRORS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
