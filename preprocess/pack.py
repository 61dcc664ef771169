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
import time
from pathlib import Path
from typing import Any

from clipforge.base.errors import UserError
from clipforge.base.logs import Progress
from clipforge.hpc.collective import over_mpi, rank_zero_decides
from clipforge.hpc.lock import WriterLock
from clipforge.hpc.lustre import stripe_directory
from clipforge.hpc.mpi import Counters, WorkList, mpi

from .corpus import Corpus, Listing, SplitRatios, assemble, check_paths, list_corpus
from .decode import ClipParams, VideoError, decode_clips
from .preflight import PackError, PackOptions, store_params
from .store_format import StoreError
from .store_writer import (
    ShardWriter,
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

# The slots of the counters in rank 0's window.
NEXT_VIDEO, NEXT_SHARD, DONE_VIDEOS, DONE_CLIPS, FAILED = SLOTS = range(5)


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
    cpu_seconds: float = 0.0
    """CPU time of every rank over the run, decoder threads included."""
    cores: int = 1
    """Cores the run was given: ranks times decoder threads per rank."""
    disk: int = 0
    """Bytes the shards take on disk (equal to ``bytes`` but for a block's rounding: shards have no holes)."""
    partial: int = 0
    """Packed videos that decode short of their header or lost frames midway (errors.jsonl has warnings)."""

    @property
    def clips_per_s(self) -> float:
        return self.clips / self.seconds if self.seconds else 0.0

    @property
    def busy(self) -> float:
        """The share of its cores the run kept busy (CPU time over wall time times cores)."""
        return self.cpu_seconds / (self.seconds * self.cores) if self.seconds else 0.0

    def line(self) -> str:
        return (
            f"packed {self.videos} videos into {self.clips} clips ({self.bytes / 2**20:.1f} MiB, "
            f"{self.disk / 2**20:.1f} MiB on disk) in {self.seconds:.1f} "
            "s "
            f"({self.clips_per_s:.1f} clips/s, {self.busy:.0%} of {self.cores} "
            f"{'core' if self.cores == 1 else 'cores'} busy); {self.partial} partial or damaged, {self.failed} failed, "
            f"{self.skipped} skipped; "
            f"{self.reused_shards} shards kept from an earlier run"
        )


@dataclasses.dataclass
class PackPlan:
    """Rank 0's plan of a packing run: the store's video table, and what is left of it to pack."""

    table: dict[str, Any]
    """The video table kept in videos.json: ``root``, ``classes``, and ``videos`` (path, label, split) in id order."""
    todo: list[int]
    """Ids of the videos left to pack, in the order ranks take them (longest first)."""
    next_shard: int = 0
    """The number of the first new shard (committed shards keep theirs)."""
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path, reason) of each file the scan did not take."""
    reused: int = 0
    """Committed shards kept from an earlier run."""

    def items(self) -> list[tuple[int, int, str]]:
        """The work, in order: (video id, label index, path) of every video left to do."""
        label_of = {c: i for i, c in enumerate(self.table["classes"])}
        videos = self.table["videos"]
        return [(i, label_of[videos[i]["label"]], videos[i]["path"]) for i in self.todo]


def video_table(corpus: Corpus) -> dict[str, Any]:
    """The video table of a store packed from ``corpus`` alone (ids are positions in ``videos``)."""
    return {
        "root": str(corpus.root),
        "classes": corpus.classes,
        "videos": [dataclasses.asdict(v) for v in corpus.videos],
    }


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
    started, cpu_started = time.time(), time.process_time()
    lock = WriterLock(out, "clip store") if comm.rank == 0 else None  # one packing job per store
    try:
        corpus = scan_corpus(source, ratios, params, comm)
        plan: PackPlan | None = None

        def decide() -> tuple[str, int]:  # what every rank needs of the plan: a few numbers, not the video table
            nonlocal plan
            plan = _plan(corpus, out, params, options, lock)
            return plan.table["root"], plan.next_shard

        root, next_shard = rank_zero_decides(decide, lock is not None, over_mpi(comm), error=PackError)
        work = WorkList(comm, plan.items() if lock else None)
        counters = Counters(comm, [next_shard if slot == NEXT_SHARD else 0 for slot in SLOTS])
        try:
            _work(work, Path(root), out, params, options, comm, counters)
        finally:
            counters.free()
            work.free()
        others = comm.gather(time.process_time() - cpu_started, root=0)
        if not lock:
            return None
        summary = _finish(plan, out, time.time() - started)
        summary.cpu_seconds = time.process_time() - cpu_started + sum(others[1:])
        summary.cores = comm.size * params.decode_threads
        log.info("%s", summary.line())
        return summary
    finally:
        if lock:
            lock.release()


def scan_corpus(source: Path, ratios: SplitRatios, params: ClipParams, comm) -> Corpus | PackError | None:
    """Rank 0 lists the corpus; every rank resolves and stats its share of the paths; rank 0 assembles it.

    Every rank of ``comm`` calls this. Rank 0 gets the corpus, or the :class:`PackError` that assembling it
    ended with (for :func:`pack_corpus` to hand every rank); the others get None. A corpus that cannot be
    listed raises the :class:`PackError` on every rank.

    A million-file corpus on Lustre is millions of metadata calls (resolve, stat, access): shared by the
    ranks they take 1/N of the time, and no rank but 0 ever holds more than its share of the listing.
    """
    listing: Listing | None = None

    def listed() -> None:  # rank 0 keeps the listing; the others learn only whether it failed
        nonlocal listing
        params.check()
        listing = list_corpus(source)

    rank_zero_decides(listed, comm.rank == 0, over_mpi(comm), error=PackError)
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
) -> PackPlan:
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
        fresh = video_table(corpus)
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
        _log_skipped(corpus.skipped)
        return PackPlan(
            table=table,
            todo=todo,
            next_shard=max((m["number"] for m in markers), default=-1) + 1,
            skipped=corpus.skipped,
            reused=len(markers),
        )
    except UserError as exc:
        raise PackError(str(exc)) from None


SKIPPED_SHOWN = 5
"""Skipped files named in the log for each reason; the rest are counted (``errors.jsonl`` has every one)."""


def _log_skipped(skipped: list[tuple[str, str]]) -> None:
    """A line per skipped file up to :data:`SKIPPED_SHOWN` for each reason, then one count: a corpus with a
    sidecar file beside each of a million videos would otherwise write a million lines into the Slurm log."""
    by_reason: dict[str, list[str]] = {}
    for path, reason in skipped:
        by_reason.setdefault(reason, []).append(path)
    for reason, paths in by_reason.items():
        for path in paths[:SKIPPED_SHOWN]:
            log.warning("not packed: %s: %s", path, reason)
        if len(paths) > SKIPPED_SHOWN:
            log.warning("not packed: %d more files: %s (every one in errors.jsonl)", len(paths) - SKIPPED_SHOWN, reason)


def _work(
    work: WorkList, root: Path, out: Path, params: ClipParams, options: PackOptions, comm, counters: Counters
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


def _finish(plan: PackPlan, out: Path, seconds: float) -> PackSummary:
    """Rank 0: the index and errors.jsonl from every committed shard, and the summary."""
    out = Path(out)
    table = plan.table
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
        for p, r in plan.skipped
    ]
    write_errors(out, errors)
    summary = PackSummary(
        videos=sum(1 for v in videos if v["status"] == "ok" or v["status"].startswith(WARNINGS)),
        partial=sum(1 for v in videos if v["status"].startswith(WARNINGS)),
        clips=sum(m["num_clips"] for m in markers),
        failed=len(failures),
        skipped=sum(1 for v in videos if v["status"].startswith("skipped")) + len(plan.skipped),
        bytes=sum(m["size"] for m in markers),
        disk=sum(m.get("disk", m["size"]) for m in markers),
        seconds=seconds,
        reused_shards=plan.reused,
    )
    return summary


def _merge_tables(old: dict[str, Any], corpus: Corpus) -> dict[str, Any]:
    """Append mode: keep every existing video id, add the corpus's new videos after them."""
    known = {v["path"] for v in old["videos"]}
    new = [dataclasses.asdict(v) for v in corpus.videos if v.path not in known]
    classes = old["classes"] + sorted({v["label"] for v in new} - set(old["classes"]))
    return {"root": old["root"], "classes": classes, "videos": old["videos"] + new}
