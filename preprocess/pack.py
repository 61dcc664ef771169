"""Packing a corpus into a clip store with MPI ranks.

Every rank writes its own shard files (file-per-process: no shared-file locks
on Lustre, and h5py from PyPI has no parallel HDF5). Work is handed out
dynamically, longest video first, through a counter in an MPI window that
every rank increments atomically (``MPI_Fetch_and_op``): no rank idles while
another grinds through a long video, and no rank is a dispatcher only. Rank 0
plans, then works like the others, then writes the index.

A rerun of the same command on the same directory does only what is missing:
committed shards are kept, the videos of half-written ones are redone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from clipforge.hpc.errors import UserError
from clipforge.hpc.lock import WriterLock
from clipforge.hpc.logs import Progress
from clipforge.hpc.lustre import stripe_directory

from .corpus import Corpus, SplitRatios, scan
from .decode import ClipParams, VideoError, decode_clips
from .store import (
    Codec,
    ShardWriter,
    StoreError,
    committed_markers,
    remove_store,
    write_errors,
    write_index,
    write_params,
    write_videos,
)

log = logging.getLogger(__name__)

# Statuses of videos that are packed but not whole: listed in errors.jsonl as warnings.
WARNINGS = ("partial", "damaged")
# What the video table holds for a video that has no clips (failed, or not reached).
UNPACKED = {
    "fps": 0.0,
    "duration": 0.0,
    "frames": 0,
    "clips": 0,
    "timing": "",
    "promised_frames": 0,
    "first_time": 0.0,
    "last_time": 0.0,
    "repeated_clips": 0,
}

# Counters in rank 0's window.
NEXT_VIDEO, NEXT_SHARD, DONE_VIDEOS, DONE_CLIPS, FAILED = range(5)


@dataclasses.dataclass(frozen=True)
class PackOptions:
    codec: Codec = "raw"
    """raw: uncompressed uint8 clips; jpeg: per-frame JPEG, ~10x smaller, decoded on read."""
    jpeg_quality: int = 90
    """JPEG quality for the jpeg codec."""
    max_shard_clips: int = 4096
    """Start a new shard after this many clips (a killed rank then loses at most one shard's work)."""
    overwrite: bool = False
    """Rebuild a store that was packed with other parameters."""
    append: bool = False
    """Add the corpus's new videos to an existing store as new shards, leaving the old ones alone."""


@dataclasses.dataclass
class PackSummary:
    videos: int
    """Videos with clips in the store, partial and damaged ones included."""
    clips: int
    failed: int
    skipped: int
    bytes: int
    seconds: float
    reused_shards: int
    disk: int = 0
    """Bytes the shards take on disk (equal to ``bytes`` but for a block's rounding: shards have no holes)."""
    partial: int = 0
    """Packed videos that decode short of their header or lost frames midway (errors.jsonl has warnings)."""

    @property
    def clips_per_s(self) -> float:
        return self.clips / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        return (
            f"packed {self.videos} videos into {self.clips} clips ({self.bytes / 2**20:.1f} MiB, "
            f"{self.disk / 2**20:.1f} MiB on disk) in {self.seconds:.1f} "
            "s "
            f"({self.clips_per_s:.1f} clips/s); {self.partial} partial or damaged, {self.failed} failed, "
            f"{self.skipped} skipped; "
            f"{self.reused_shards} shards kept from an earlier run"
        )


class PackError(UserError):
    """Packing cannot start as asked; the message names the input."""


def store_params(params: ClipParams, options: PackOptions) -> dict[str, Any]:
    """Everything that decides a store's bytes: a rerun with other values refuses to mix them in."""
    return {**dataclasses.asdict(params), "codec": options.codec, "jpeg_quality": options.jpeg_quality}


def pack_corpus(
    source: Path,
    out: Path,
    params: ClipParams,
    options: PackOptions = PackOptions(),
    ratios: SplitRatios = SplitRatios(),
    comm=None,
) -> PackSummary | None:
    """Pack the videos of ``source`` into a clip store at ``out``; every rank of ``comm`` calls this.

    Returns the summary on rank 0 and None elsewhere.
    """
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    started = time.time()
    lock = WriterLock(out, "clip store") if comm.rank == 0 else None  # one packing job per store
    try:
        plan = _plan(source, out, params, options, ratios, lock) if lock else None
        plan = comm.bcast(plan, root=0)
        if isinstance(plan, Exception):
            raise plan  # every rank stops with rank 0's one-line reason
        counters = _Counters(comm, plan["next_shard"])
        try:
            _work(plan, out, params, options, comm, counters)
        finally:
            counters.free()
        return _finish(plan, out, time.time() - started) if lock else None
    finally:
        if lock:
            lock.release()


def _plan(
    source: Path, out: Path, params: ClipParams, options: PackOptions, ratios: SplitRatios, lock: WriterLock
) -> dict[str, Any] | Exception:
    """Rank 0: scan, take the store's writer lock, check the directory, list what is left to do (longest first)."""
    try:
        params.check()
        corpus = scan(source, ratios)
        out = Path(out)
        stripe_directory(out, count=1)  # file-per-process shards: one OST each, set before the first byte
        stripe_directory(out / "shards", count=1)
        lock.acquire()
        existing = out / "videos.json"
        old = json.loads(existing.read_text()) if existing.exists() else None
        fresh = {
            "root": str(corpus.root),
            "classes": corpus.classes,
            "videos": [dataclasses.asdict(v) for v in corpus.videos],
        }
        table = _merge_tables(old, corpus) if options.append and old else fresh
        if old is not None and not options.append and old != fresh:
            if not options.overwrite:
                raise StoreError(
                    f"{out} holds a store of another corpus or split; pass --append to add new videos, "
                    "--overwrite to rebuild it, or choose a new directory"
                )
            remove_store(out)
        write_params(out, store_params(params, options), options.overwrite)
        write_videos(out, table)
        markers = committed_markers(out)
        done = {int(k) for m in markers for k in (*m["videos"], *m["failed"])}
        root = Path(table["root"])
        todo = [i for i in range(len(table["videos"])) if i not in done]
        size = {i: _size(root / table["videos"][i]["path"]) for i in todo}
        todo.sort(key=lambda i: (-size[i], i))  # longest (by bytes) first
        log.info(
            "%d videos in %d classes; %d already packed in %d shards, %d to do",
            len(table["videos"]),
            len(table["classes"]),
            len(done),
            len(markers),
            len(todo),
        )
        for path, reason in corpus.skipped:
            log.warning("not packed: %s: %s", path, reason)
        return {
            "table": table,
            "todo": todo,
            "next_shard": max((m["number"] for m in markers), default=-1) + 1,
            "skipped": corpus.skipped,
            "reused": len(markers),
        }
    except UserError as exc:
        return PackError(str(exc))


def _work(plan: dict[str, Any], out: Path, params: ClipParams, options: PackOptions, comm, counters: _Counters) -> None:
    table, todo = plan["table"], plan["todo"]
    root, classes = Path(table["root"]), table["classes"]
    writer: ShardWriter | None = None
    bar = Progress(len(todo), "packing", unit="video", enabled=comm.rank == 0)
    shown = 0
    try:
        while True:
            i = counters.fetch_add(NEXT_VIDEO)
            if i >= len(todo):
                break
            video_id = todo[i]
            video = table["videos"][video_id]
            if writer is None:
                writer = ShardWriter(
                    out,
                    counters.fetch_add(NEXT_SHARD),
                    (params.clip_frames, params.height, params.width),
                    options.codec,
                    options.jpeg_quality,
                )
            try:
                result = decode_clips(root / video["path"], params)
            except VideoError as exc:
                writer.add_failure(video_id, str(exc))
                counters.fetch_add(FAILED)
            except Exception as exc:  # noqa: BLE001 - a decoder bug on one file must not stop the others
                writer.add_failure(video_id, f"unexpected {type(exc).__name__}: {exc}")
                counters.fetch_add(FAILED)
            else:
                writer.add_video(video_id, classes.index(video["label"]), result.clips, result.starts, result.record())
                counters.fetch_add(DONE_CLIPS, len(result.clips))
            counters.fetch_add(DONE_VIDEOS)
            if writer.num_clips >= options.max_shard_clips:
                writer.commit()
                writer = None
            if comm.rank == 0:
                done, clips, failed = counters.read(DONE_VIDEOS), counters.read(DONE_CLIPS), counters.read(FAILED)
                bar.update(done - shown, clips=clips, errors=failed)
                shown = done
        if writer is not None:
            writer.commit()
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
    if comm.rank == 0:
        comm.Barrier()  # the others' last videos
        bar.update(counters.read(DONE_VIDEOS) - shown, clips=counters.read(DONE_CLIPS), errors=counters.read(FAILED))
        bar.close()
    else:
        comm.Barrier()


def _finish(plan: dict[str, Any], out: Path, seconds: float) -> PackSummary:
    """Rank 0: the index and errors.jsonl from every committed shard, and the summary."""
    out = Path(out)
    table = plan["table"]
    markers = committed_markers(out)
    found: dict[int, dict[str, Any]] = {}
    failures: dict[int, str] = {}
    for m in markers:
        found.update({int(k): v for k, v in m["videos"].items()})
        failures.update({int(k): v for k, v in m["failed"].items()})
    label_of = {c: i for i, c in enumerate(table["classes"])}
    videos = []
    for i, v in enumerate(table["videos"]):
        info = {**UNPACKED, **found.get(i, {"status": f"failed: {failures.get(i, 'not packed')}"})}
        videos.append(
            {
                "path": v["path"],
                "label": label_of[v["label"]],
                "split": v["split"],
                "num_clips": info.pop("clips"),
                **info,
            }
        )
    params = json.loads((out / "params.json").read_text())
    write_index(out, videos, table["classes"], params, markers)
    errors = [
        {"path": table["videos"][i]["path"], "video_id": i, "reason": r, "level": "error"}
        for i, r in sorted(failures.items())
    ]
    errors += [
        {"path": v["path"], "video_id": i, "reason": v["status"], "level": "error"}
        for i, v in enumerate(videos)
        if v["status"].startswith("skipped")
    ]
    # Packed, but not whole: the clips come from what decodes, and the user should know what is missing.
    errors += [
        {"path": v["path"], "video_id": i, "reason": v["status"], "level": "warning"}
        for i, v in enumerate(videos)
        if v["status"].startswith(WARNINGS)
    ]
    errors += [
        {"path": p, "video_id": None, "reason": f"not taken by the scan: {r}", "level": "error"}
        for p, r in plan["skipped"]
    ]
    write_errors(out, errors)
    summary = PackSummary(
        videos=sum(1 for v in videos if v["status"] == "ok" or v["status"].startswith(WARNINGS)),
        partial=sum(1 for v in videos if v["status"].startswith(WARNINGS)),
        clips=sum(m["num_clips"] for m in markers),
        failed=len(failures),
        skipped=sum(1 for v in videos if v["status"].startswith("skipped")) + len(plan["skipped"]),
        bytes=sum(m["size"] for m in markers),
        disk=sum(m.get("disk", m["size"]) for m in markers),
        seconds=seconds,
        reused_shards=plan["reused"],
    )
    log.info("%s", summary.line())
    return summary


class _Counters:
    """Shared counters in rank 0's memory, updated with one-sided atomics."""

    def __init__(self, comm, first_shard: int) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.win = MPI.Win.Allocate(5 * 8 if comm.rank == 0 else 0, 8, comm=comm)
        if comm.rank == 0:
            mem = np.frombuffer(self.win.tomemory(), dtype=np.int64)
            mem[:] = 0
            mem[NEXT_SHARD] = first_shard
        comm.Barrier()
        self._one = np.zeros(1, np.int64)
        self._out = np.zeros(1, np.int64)

    def fetch_add(self, slot: int, amount: int = 1) -> int:
        self._one[0] = amount
        self.win.Lock(0, self.MPI.LOCK_SHARED)
        self.win.Fetch_and_op(self._one, self._out, 0, slot, self.MPI.SUM)
        self.win.Unlock(0)
        return int(self._out[0])

    def read(self, slot: int) -> int:
        self.win.Lock(0, self.MPI.LOCK_SHARED)
        self.win.Fetch_and_op(self._one, self._out, 0, slot, self.MPI.NO_OP)
        self.win.Unlock(0)
        return int(self._out[0])

    def free(self) -> None:
        self.win.Free()


def _merge_tables(old: dict[str, Any], corpus: Corpus) -> dict[str, Any]:
    """Append mode: keep every existing video id, add the corpus's new videos after them."""
    known = {v["path"] for v in old["videos"]}
    new = [dataclasses.asdict(v) for v in corpus.videos if v.path not in known]
    classes = old["classes"] + sorted({v["label"] for v in new} - set(old["classes"]))
    return {"root": old["root"], "classes": classes, "videos": old["videos"] + new}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
