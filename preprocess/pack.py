"""Packing a corpus into a clip store with MPI ranks.

Every rank writes its own shard files (file-per-process: no shared-file locks
on Lustre, and h5py from PyPI has no parallel HDF5). Work is handed out
dynamically, longest video first, through a counter in an MPI window that
every rank increments atomically (``MPI_Fetch_and_op``): no rank idles while
another grinds through a long video, and no rank is a dispatcher only. Rank 0
lists the corpus, every rank checks (resolves, stats) its share of the paths,
rank 0 plans; the work list stays in rank 0's memory and each rank fetches the
items it takes, so no rank but 0 holds the video table. Rank 0 then works like
the others, then writes the index.

A rerun of the same command on the same directory does only what is missing:
committed shards are kept, the videos of half-written ones are redone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from clipforge.base.errors import UserError
from clipforge.base.logs import Progress
from clipforge.hpc.lock import WriterLock
from clipforge.hpc.lustre import stripe_directory
from clipforge.hpc.mpi import mpi

from .corpus import Corpus, Listing, SplitRatios, assemble, check_paths, list_corpus, probe_corpus
from .decode import ClipParams, VideoError, decode_clips
from .store import (
    Codec,
    ShardWriter,
    StoreError,
    check_params,
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


def preflight(source: Path, out: Path, params: ClipParams, options: PackOptions) -> None:
    """What the submitter checks before a packing job waits in a queue: parameters, corpus, output directory.

    Seconds, not a corpus walk: a tree is read until its first video and a manifest's first
    paths are looked at. Each problem is one :class:`UserError` line.
    """
    params.check()
    if options.max_shard_clips < 1:
        raise PackError(f"--max-shard-clips is {options.max_shard_clips}; give a number of clips, at least 1")
    if not 1 <= options.jpeg_quality <= 100:
        raise PackError(f"--jpeg-quality is {options.jpeg_quality}; give a JPEG quality from 1 to 100")
    probe_corpus(source)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PackError(f"--out {out} is a file; give a directory for the clip store")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PackError(f"--out {out}: {existing} is not writable by you; choose a directory you can write")
    if out.is_dir():
        if not options.overwrite:
            check_params(out, store_params(params, options))
        WriterLock(out, "clip store").check_free()


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
    MPI = mpi()

    comm = comm or MPI.COMM_WORLD
    started = time.time()
    lock = WriterLock(out, "clip store") if comm.rank == 0 else None  # one packing job per store
    try:
        corpus = _scan_together(source, ratios, params, comm)
        plan = _plan(corpus, out, params, options, lock) if lock else None
        header = comm.bcast(plan if plan is None or isinstance(plan, Exception) else _header(plan), root=0)
        if isinstance(header, Exception):
            raise header  # every rank stops with rank 0's one-line reason
        work = _WorkList(comm, _items(plan) if lock else None)
        counters = _Counters(comm, header["next_shard"])
        try:
            _work(work, Path(header["root"]), out, params, options, comm, counters)
        finally:
            counters.free()
            work.free()
        return _finish(plan, out, time.time() - started) if lock else None
    finally:
        if lock:
            lock.release()


def _scan_together(source: Path, ratios: SplitRatios, params: ClipParams, comm) -> Corpus | None:
    """Rank 0 lists the corpus; every rank resolves and stats its share of the paths; rank 0 assembles it.

    A million-file corpus on Lustre is millions of metadata calls (resolve, stat, access): shared by the
    ranks they take 1/N of the time, and no rank but 0 ever holds more than its share of the listing.
    """
    listing: Listing | Exception | None = None
    if comm.rank == 0:
        try:
            params.check()
            listing = list_corpus(source)
        except UserError as exc:
            listing = PackError(str(exc))
    failed = comm.bcast(listing if isinstance(listing, Exception) else None, root=0)
    if failed is not None:
        raise failed
    if comm.rank == 0:
        assert isinstance(listing, Listing)
        rels = [rel for rel, _, _ in listing.entries]
        share = -(-len(rels) // comm.size)
        chunks = [(listing.root, rels[r * share : (r + 1) * share]) for r in range(comm.size)]
    mine = comm.scatter(chunks if comm.rank == 0 else None, root=0)
    checks = comm.gather(check_paths(*mine), root=0)
    if comm.rank != 0:
        return None
    try:
        return assemble(listing, [c for part in checks for c in part], ratios)
    except UserError as exc:
        return PackError(str(exc))


def _plan(
    corpus: Corpus | PackError, out: Path, params: ClipParams, options: PackOptions, lock: WriterLock
) -> dict[str, Any] | Exception:
    """Rank 0: take the store's writer lock, check the directory, list what is left to do (longest first)."""
    try:
        if isinstance(corpus, PackError):
            raise corpus
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
        todo = [i for i in range(len(table["videos"])) if i not in done]
        size = {i: corpus.sizes.get(table["videos"][i]["path"], 0) for i in todo}  # stat'ed by the scan
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


def _header(plan: dict[str, Any]) -> dict[str, Any]:
    """What every rank needs of the plan: a few numbers, not the video table."""
    return {"root": plan["table"]["root"], "next_shard": plan["next_shard"]}


def _items(plan: dict[str, Any]) -> list[tuple[int, int, str]]:
    """The work, in order: (video id, label index, path) of every video left to do."""
    table = plan["table"]
    label_of = {c: i for i, c in enumerate(table["classes"])}
    return [(i, label_of[table["videos"][i]["label"]], table["videos"][i]["path"]) for i in plan["todo"]]


def _work(
    work: _WorkList, root: Path, out: Path, params: ClipParams, options: PackOptions, comm, counters: _Counters
) -> None:
    writer: ShardWriter | None = None
    bar = Progress(len(work), "packing", unit="video", enabled=comm.rank == 0)
    shown = 0
    try:
        while True:
            i = counters.fetch_add(NEXT_VIDEO)
            if i >= len(work):
                break
            video_id, label, path = work.get(i)
            if writer is None:
                writer = ShardWriter(
                    out,
                    counters.fetch_add(NEXT_SHARD),
                    (params.clip_frames, params.height, params.width),
                    options.codec,
                    options.jpeg_quality,
                )
            try:
                result = decode_clips(root / path, params)
            except VideoError as exc:
                writer.add_failure(video_id, str(exc))
                counters.fetch_add(FAILED)
            except Exception as exc:  # noqa: BLE001 - a decoder bug on one file must not stop the others
                writer.add_failure(video_id, f"unexpected {type(exc).__name__}: {exc}")
                counters.fetch_add(FAILED)
            else:
                writer.add_video(video_id, label, result.clips, result.starts, result.record())
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


class _WorkList:
    """The videos left to pack, held in rank 0's memory; a rank reads an item when it takes it (``MPI_Get``).

    No rank receives the list: a million listed videos are a few dozen MB on rank 0 and, on every other
    rank, only the items it packs.
    """

    def __init__(self, comm, items: list[tuple[int, int, str]] | None) -> None:
        MPI = mpi()

        self.MPI = MPI
        root = comm.rank == 0
        paths = [p.encode() for _, _, p in items] if root else []
        self.n = comm.bcast(len(paths) if root else None, root=0)
        nbytes = sum(map(len, paths))
        self.records = MPI.Win.Allocate(self.n * 4 * 8 if root else 0, 8, comm=comm)
        self.paths = MPI.Win.Allocate(max(nbytes, 1) if root else 0, 1, comm=comm)
        if root:
            records = np.frombuffer(self.records.tomemory(), dtype=np.int64).reshape(self.n, 4)
            lengths = np.array([len(p) for p in paths], np.int64)
            records[:, 0] = [v for v, _, _ in items]
            records[:, 1] = [label for _, label, _ in items]
            records[:, 2] = np.cumsum(lengths) - lengths
            records[:, 3] = lengths
            np.frombuffer(self.paths.tomemory(), dtype=np.uint8)[:nbytes] = np.frombuffer(b"".join(paths), np.uint8)
        comm.Barrier()

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> tuple[int, int, str]:
        """(video id, label index, path) of item ``i``."""
        MPI = self.MPI
        record = np.empty(4, np.int64)
        self.records.Lock(0, MPI.LOCK_SHARED)
        self.records.Get(record, 0, target=(i * 4, 4, MPI.INT64_T))
        self.records.Unlock(0)
        path = np.empty(int(record[3]), np.uint8)
        self.paths.Lock(0, MPI.LOCK_SHARED)
        self.paths.Get(path, 0, target=(int(record[2]), len(path), MPI.BYTE))
        self.paths.Unlock(0)
        return int(record[0]), int(record[1]), path.tobytes().decode()

    def free(self) -> None:
        self.records.Free()
        self.paths.Free()


class _Counters:
    """Shared counters in rank 0's memory, updated with one-sided atomics."""

    def __init__(self, comm, first_shard: int) -> None:
        MPI = mpi()

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
