"""The clip store's HDF5 layout: the writer and the reader side by side.

No other module knows a dataset name. A store is a directory:

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

import dataclasses
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import h5py
import numpy as np

from clipforge.base.errors import UserError
from clipforge.base.files import sha256, write_json, write_text

if TYPE_CHECKING:
    import torch  # the packer never imports torch; the device decode does, when called

FORMAT_VERSION = 1
Codec = Literal["raw", "jpeg"]
# Chunks are not aligned to stripes. Shards are single-stripe files (``lfs setstripe -c 1``), so a
# chunk never spans OSTs and alignment buys nothing but holes (a 221 KB clip in a 1 MiB slot made
# shards 4.7x their data); unaligned, bytes on disk equal the apparent size.
# Shard handles one process keeps open (least recently used closed first): well under a 1,024 fd limit
# divided by the DataLoader workers of a rank.
MAX_OPEN_SHARDS = 64
SPLIT_NAMES = ("train", "val", "test")
# The video table in index.h5: one entry per scanned video, in id order.
VIDEO_TEXT = ("path", "split", "status", "timing")
# Per-clip columns: in every shard, and copied whole into index.h5 (columns/...).
CLIP_COLUMNS = {"labels": np.int64, "video_ids": np.int64, "clip_index": np.int32, "start_times": np.float64}
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


class StoreError(UserError):
    """A clip store that cannot be used as it is; the message names the file and what to do."""


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def _h5(path: Path, mode: str) -> h5py.File:
    # locking=False: HDF5's file locks fail or hang on Lustre and NFS (h5py #1101).
    if mode == "r":
        return h5py.File(path, "r", locking=False)
    return h5py.File(path, mode, locking=False)


# --------------------------------------------------------------------------- writing
class ShardWriter:
    """Appends the clips of whole videos to one shard file; :meth:`commit` makes it part of the store."""

    def __init__(
        self, store: Path, number: int, clip_shape: tuple[int, int, int], codec: Codec, jpeg_quality: int = 90
    ):
        self.store, self.number, self.codec, self.jpeg_quality = Path(store), number, codec, jpeg_quality
        self.final = self.store / "shards" / f"{shard_name(number)}.h5"
        self.tmp = self.final.with_suffix(".h5.tmp")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.file = _h5(self.tmp, "w")
        t, h, w = clip_shape
        if codec == "raw":
            self.clips = self.file.create_dataset(
                "clips", shape=(0, t, h, w, 3), maxshape=(None, t, h, w, 3), dtype=np.uint8, chunks=(1, t, h, w, 3)
            )
        else:
            self.clips = self.file.create_dataset(
                "clips", shape=(0, t), maxshape=(None, t), dtype=h5py.vlen_dtype(np.uint8), chunks=(1, t)
            )
        self.columns = {
            name: self.file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
            for name, dtype in CLIP_COLUMNS.items()
        }
        self.file.attrs["format_version"] = FORMAT_VERSION
        self.file.attrs["codec"] = codec
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
            self.clips[lo:hi] = clips if self.codec == "raw" else encode_jpeg(clips, self.jpeg_quality)
            for name, values in (
                ("labels", [label] * n),
                ("video_ids", [video_id] * n),
                ("clip_index", range(n)),
                ("start_times", starts),
            ):
                self.columns[name].resize(hi, axis=0)
                self.columns[name][lo:hi] = np.asarray(list(values))
        self.num_clips = hi
        self.videos[video_id] = {**info, "clips": n}

    def add_failure(self, video_id: int, reason: str) -> None:
        self.failed[video_id] = reason

    @property
    def nbytes(self) -> int:
        return self.file.id.get_filesize()

    def commit(self) -> dict[str, Any]:
        """Flush, rename into place, then write the marker; returns the marker."""
        self.file.attrs["num_clips"] = self.num_clips
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


def encode_jpeg(clips: np.ndarray, quality: int) -> np.ndarray:
    """``[N, T, H, W, 3]`` uint8 to an ``[N, T]`` object array of JPEG bytes (one per frame)."""
    from PIL import Image

    out = np.empty(clips.shape[:2], dtype=object)
    for i in range(clips.shape[0]):
        for t in range(clips.shape[1]):
            buffer = io.BytesIO()
            Image.fromarray(clips[i, t]).save(buffer, format="JPEG", quality=quality)
            out[i, t] = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
    return out


def decode_jpeg(frames: Iterable[np.ndarray]) -> np.ndarray:
    """JPEG bytes of each frame to ``[T, H, W, 3]`` uint8, with libjpeg-turbo through simplejpeg.

    simplejpeg decodes straight into an HWC array: 1.9x Pillow per core on 224x224 camera frames, where
    torchvision's ``decode_jpeg`` gave 1.4x (its CHW tensors need a transpose and a copy) and warns at
    every call that its image codecs are deprecated (torchvision 0.29).
    """
    import simplejpeg

    return np.stack([simplejpeg.decode_jpeg(np.asarray(f), colorspace="RGB") for f in frames])


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


def decode_jpeg_batch(clips: list[list[np.ndarray]], device) -> torch.Tensor:
    """Encoded clips (each a list of T frames' JPEG bytes) to ``[B, T, H, W, 3]`` uint8 on ``device``.

    One ``torchvision.io.decode_jpeg`` call over every frame of the batch: on a CUDA device that is
    nvJPEG's batched decode, and the host only moves the compressed bytes (about a tenth of the raw
    clip); on the CPU it is libjpeg-turbo, pixel for pixel what :func:`decode_jpeg` gives.
    """
    import warnings

    import torch
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    frames = [torch.from_numpy(np.asarray(f)) for clip in clips for f in clip]
    with warnings.catch_warnings():  # torchvision 0.29 warns at every call that its image codecs will move
        warnings.simplefilter("ignore")
        decoded = tv_decode_jpeg(frames, device=torch.device(device))
    t = len(clips[0]) if clips else 0
    return torch.stack(decoded).permute(0, 2, 3, 1).reshape(len(clips), t, *decoded[0].shape[1:], 3)


def committed_markers(store: Path) -> list[dict[str, Any]]:
    """Markers of the shards that finished, in shard-number order; half-written shards are removed."""
    shards = Path(store) / "shards"
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
    path = Path(store) / "params.json"
    if path.exists():
        if not overwrite:
            check_params(store, params)
        if json.loads(path.read_text()) != params:
            remove_store(store)
    Path(store).mkdir(parents=True, exist_ok=True)
    write_json(path, params, sort_keys=True)


def check_params(store: Path, params: dict[str, Any]) -> None:
    """Refuse to pack ``params`` into a store that was packed with others."""
    path = Path(store) / "params.json"
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
    for pattern in ("shards/shard-*", "index.h5", "errors.jsonl", "params.json", "videos.json"):
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
    tmp = store / "index.h5.tmp"
    with _h5(tmp, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["params"] = json.dumps(params, sort_keys=True)
        f.attrs["num_clips"] = total
        f.create_dataset("classes", data=np.array(classes, dtype=object), dtype=h5py.string_dtype())
        table = f.create_group("videos")
        for key in VIDEO_TEXT:
            table.create_dataset(key, data=np.array([v[key] for v in videos], dtype=object), dtype=h5py.string_dtype())
        for key, dtype in VIDEO_NUMBERS.items():
            table.create_dataset(key, data=np.array([v[key] for v in videos], dtype=dtype))
        shards = f.create_group("shards")
        shards.create_dataset(
            "name", data=np.array([m["shard"] for m in markers], dtype=object), dtype=h5py.string_dtype()
        )
        shards.create_dataset("size", data=np.array([m["size"] for m in markers], dtype=np.int64))
        shards.create_dataset("num_clips", data=np.array(counts, dtype=np.int64))
        shards.create_dataset("offset", data=offsets[:-1])
        shards.create_dataset("disk", data=np.array([m.get("disk", m["size"]) for m in markers], dtype=np.int64))
        # Real copies of the small per-clip columns, so that opening the store reads this file alone; the
        # virtual datasets beside them are for outside tools (h5ls, h5dump), and reading one opens every shard.
        columns = {name: np.empty(total, dtype) for name, dtype in CLIP_COLUMNS.items()}
        layouts: dict[str, h5py.VirtualLayout] = {}
        for m, lo in zip(markers, offsets):
            if not m["num_clips"]:
                continue
            with _h5(store / "shards" / m["shard"], "r") as shard:
                for name in ("clips", *CLIP_COLUMNS):
                    ds = shard[name]
                    if name not in layouts:
                        layouts[name] = h5py.VirtualLayout(shape=(total, *ds.shape[1:]), dtype=ds.dtype)
                    layouts[name][lo : lo + m["num_clips"]] = h5py.VirtualSource(
                        f"shards/{m['shard']}", name, shape=ds.shape
                    )
                    if name in columns:
                        columns[name][lo : lo + m["num_clips"]] = ds[:]
        for name, layout in layouts.items():
            f.create_virtual_dataset(name, layout)
        for name, values in columns.items():
            f.create_dataset(f"columns/{name}", data=values)
        video_ids, clip_index = columns["video_ids"], columns["clip_index"]
        # Index order: by video, then by clip, whichever rank wrote what.
        order = np.lexsort((clip_index, video_ids)) if total else np.zeros(0, np.int64)
        f.create_dataset("order", data=order.astype(np.int64))
        split_of_video = np.array([v["split"] for v in videos], dtype=object)
        splits = f.create_group("splits")
        for split in SPLIT_NAMES:
            chosen = order[split_of_video[video_ids[order]] == split] if total else order
            splits.create_dataset(split, data=chosen.astype(np.int64))
    os.replace(tmp, store / "index.h5")
    return store / "index.h5"


def write_errors(store: Path, errors: list[dict[str, Any]]) -> None:
    write_text(Path(store) / "errors.jsonl", "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors))


def read_errors(store: Path) -> list[dict[str, Any]]:
    """Every video that failed or was skipped, and why (empty before the first pack)."""
    path = Path(store) / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write_videos(store: Path, table: dict[str, Any]) -> None:
    """The scanned video table (ids are positions in it), kept for reruns."""
    write_text(Path(store) / "videos.json", json.dumps(table))


# --------------------------------------------------------------------------- reading
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
        index = root / "index.h5"
        if not index.exists():
            raise StoreError(f"{root} has no index.h5: it is not a clip store, or its packing job has not finished")
        with _h5(index, "r") as f:
            if f.attrs.get("format_version") != FORMAT_VERSION:
                raise StoreError(
                    f"{index}: format version {f.attrs.get('format_version')} is not {FORMAT_VERSION}; repack it"
                )
            params = json.loads(f.attrs["params"])
            total = int(f.attrs["num_clips"])
            # Stores indexed before the columns were copied read them through the virtual datasets.
            source = f["columns"] if "columns" in f else f
            columns = {k: (source[k][:] if total else np.zeros(0)) for k in CLIP_COLUMNS}
            videos = {k: f["videos"][k][:] for k in f["videos"]}
            for k in VIDEO_TEXT:
                if k in videos:  # `timing` is missing from stores packed before it was recorded
                    videos[k] = np.array([x.decode() if isinstance(x, bytes) else x for x in videos[k]], dtype=object)
            return cls(
                root=root,
                classes=[c.decode() if isinstance(c, bytes) else c for c in f["classes"][:]],
                params=params,
                codec=params["codec"],
                labels=columns["labels"].astype(np.int64),
                video_ids=columns["video_ids"].astype(np.int64),
                clip_index=columns["clip_index"].astype(np.int64),
                start_times=columns["start_times"].astype(np.float64),
                order=f["order"][:],
                splits={s: f["splits"][s][:] for s in SPLIT_NAMES},
                videos=videos,
                shard_names=[n.decode() if isinstance(n, bytes) else n for n in f["shards/name"][:]],
                shard_offsets=f["shards/offset"][:],
                shard_sizes=f["shards/size"][:],
                shard_disk=f["shards/disk"][:] if "disk" in f["shards"] else f["shards/size"][:],
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
            "index_sha256": sha256(self.root / "index.h5"),
            "classes": list(self.classes),
            "params": self.params,
        }

    def source_paths(self, video_ids: Iterable[int], root: Path | None = None) -> list[Path]:
        """Where the source files of ``video_ids`` are: under ``root``, or the corpus root the store was packed from."""
        if root is None:
            table = self.root / "videos.json"
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
        clips = self._shard(s)["clips"]
        local = int(position - self.shard_offsets[s])
        if self.codec == "raw":
            return read_chunk(clips, local)
        return decode_jpeg(clips[local])

    def read_encoded(self, position: int) -> list[np.ndarray]:
        """The JPEG bytes of each frame of the clip at ``position`` (jpeg stores), to decode elsewhere."""
        if self.codec != "jpeg":
            raise StoreError(f"{self.root} holds {self.codec} clips; only a jpeg store has frames to decode later")
        s = int(self.shard_of(position))
        return list(self._shard(s)["clips"][int(position - self.shard_offsets[s])])

    def _shard(self, s: int) -> h5py.File:
        """Shard ``s`` opened in this process; at most ``max_open_shards`` stay open (least recently used go)."""
        key = (os.getpid(), s)
        handle = self._handles.pop(key, None)
        if handle is None:
            self._check_shard(s)
            handle = _h5(self.root / "shards" / self.shard_names[s], "r")
            self.opened += 1
            mine = [k for k in self._handles if k[0] == key[0]]
            for old in mine[: max(0, len(mine) + 1 - self.max_open_shards)]:
                self._handles.pop(old).close()
        self._handles[key] = handle  # most recently used last (dicts keep insertion order)
        return handle

    def _check_shard(self, s: int) -> None:
        """An HDF5 file cut short reads garbage or fails deep inside h5py; refuse it with its name instead."""
        path = self.root / "shards" / self.shard_names[s]
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
