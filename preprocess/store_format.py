"""The clip store's on-disk format: its files, the HDF5 dataset and attribute names, the format version.

The only module that knows a dataset name: the writer (:mod:`.store_writer`) and the reader
(:mod:`.store`) use the names below. A store is a directory:

    index.h5                 virtual datasets over the shards, classes, splits, the video table,
                             the shard table (size per shard), format version and parameters
    params.json              the parameters that made the store (written first, checked on rerun)
    videos.json              the scanned video table (ids are positions in it), kept for reruns
    shards/shard-NNNNN.h5    one writer's clips: clips [N, T, H, W, 3] uint8 (raw, one clip per chunk)
                             or [N, T] JPEG bytes (jpeg); labels, video_ids, clip_index, start_times
    shards/shard-NNNNN.json  the commit marker: what the shard holds, and the videos that failed
    errors.jsonl             every video that failed or was skipped, and why

A shard is written under a temporary name, flushed, renamed, and only then
marked: a shard without a marker is not part of the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import h5py
import numpy as np

from clipforge.base.errors import UserError

FORMAT_VERSION = 1
Codec = Literal["raw", "jpeg"]
SPLIT_NAMES = ("train", "val", "test")

# Files of a store directory.
INDEX_FILE = "index.h5"
PARAMS_FILE = "params.json"
VIDEOS_FILE = "videos.json"
ERRORS_FILE = "errors.jsonl"
SHARDS_DIR = "shards"

# Attributes: the first two on shards and index.h5 alike, the codec on shards, the parameters on index.h5.
VERSION_ATTR = "format_version"
NUM_CLIPS_ATTR = "num_clips"
CODEC_ATTR = "codec"
PARAMS_ATTR = "params"

# Datasets in every shard, and as virtual datasets over the shards in index.h5.
CLIPS = "clips"
# Per-clip columns: in every shard, and copied whole into index.h5 (COLUMNS/...).
CLIP_COLUMNS = {"labels": np.int64, "video_ids": np.int64, "clip_index": np.int32, "start_times": np.float64}

# Datasets and groups of index.h5 alone.
COLUMNS = "columns"
"""Real copies of the per-clip columns, so that opening the store reads index.h5 alone."""
CLASSES = "classes"
ORDER = "order"
"""Store positions by video, then by clip."""
SPLITS = "splits"
"""One dataset per name in SPLIT_NAMES: the positions of that split, in ORDER."""
VIDEO_TABLE = "videos"
"""The video table: one entry per scanned video, in id order, in the columns below."""
VIDEO_TEXT = ("path", "split", "status", "timing")
VIDEO_NUMBERS = {
    "label": np.int64,
    "num_clips": np.int64,
    "frames": np.int64,  # decoded
    "promised_frames": np.int64,  # what the header said (0: nothing)
    "fps": np.float64,
    "duration": np.float64,  # seconds of the decodable span
    "first_time": np.float64,  # the decodable span on the file's own clock
    "last_time": np.float64,
    "repeated_clips": np.int64,
}
SHARD_TABLE = "shards"
"""The shard table: one entry per committed shard, in the columns below."""
SHARD_NAME = f"{SHARD_TABLE}/name"
SHARD_SIZE = f"{SHARD_TABLE}/size"
"""Apparent bytes of each shard, as committed."""
SHARD_DISK = f"{SHARD_TABLE}/disk"
"""Bytes on disk of each shard, as committed (missing from stores indexed before it was recorded)."""
SHARD_NUM_CLIPS = f"{SHARD_TABLE}/num_clips"
SHARD_OFFSET = f"{SHARD_TABLE}/offset"
"""The store position of each shard's first clip."""


class StoreError(UserError):
    """A clip store that cannot be used as it is; the message names the file and what to do."""


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def open_h5(path: Path, mode: str) -> h5py.File:
    """An HDF5 file of the store, opened without file locks."""
    # locking=False: HDF5's file locks fail or hang on Lustre and NFS (h5py #1101).
    return h5py.File(path, mode, locking=False)
