"""Checkpoints of a DeepSpeed engine, written in the background: the loop waits only for a snapshot in host memory.

DeepSpeed builds the state of each checkpoint file and hands it to its checkpoint engine
(``save(state, path)``). Here that engine is :class:`SnapshotEngine`: it copies the state's tensors
into host buffers kept from one checkpoint to the next (pinned on a GPU) and returns. Once
``save_checkpoint`` has returned on a rank, its files are written by one background thread, each
hashed as it is written and synced to disk; the rank then leaves a manifest of its files. Rank 0
marks the checkpoint complete (``complete.json``) only once every rank's manifest is there, and
prunes old checkpoints, in the background too. The loop hears of a failed write at its next log
window (every rank agrees there) and stops with the last complete checkpoint intact.

Why not the writers that exist: DeepSpeed's decoupled engine commits at the next optimizer step,
waiting there for the whole write, and its writer needs the async-io op (libaio);
``torch.distributed.checkpoint.async_save`` writes its own format, which DeepSpeed's
``zero_to_fp32`` and universal-checkpoint converter cannot read, and DCP's stagers either turn
``torch.Size`` into tuples (which ``zero_to_fp32`` then fails on) or keep whole storages behind
views (every pipeline layer file would hold its stage's flat buffer). So the snapshot is a short
copy here, and the write is ``torch.save`` on one worker of a ``ThreadPoolExecutor``, as DCP's own
asynchronous save does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from clipforge.base.errors import UserError
from clipforge.hpc.distenv import DistEnv, collective_device
from clipforge.rundir import CheckpointIndex

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint could not be written; the message names the last complete one, which stays valid."""


class SnapshotEngine:
    """DeepSpeed's checkpoint-engine interface: each file's state is copied to host memory now, written later.

    The host buffers of a file are kept for the next checkpoint of the same file (same structure,
    same shapes), so only the first checkpoint allocates them; pinned memory makes the device-to-host
    copy a DMA that the GPU does at full speed.
    """

    def __init__(self, device: torch.device) -> None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        CheckpointEngine.register(SnapshotEngine)  # DeepSpeed checks the interface, not the class
        self.name = "clipforge snapshot"
        self.device = device
        self.staged: list[tuple[Any, str]] = []
        self._buffers: dict[str, Any] = {}

    # -- DeepSpeed's interface --------------------------------------------------------
    def create(self, info) -> None:
        self.staged = []

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.staged.append((self._snapshot(state_dict, Path(path).name), path))

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)  # DeepSpeed's own files

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self) -> None:
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed hands over its live tensors instead of cloning them on the device first; the
        # snapshot below is that clone, made once, into host memory.
        return False

    # -- ours -----------------------------------------------------------------------------
    def take(self) -> list[tuple[Any, str]]:
        """The files staged since :meth:`create`, once their copies have landed in host memory."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        staged, self.staged = self.staged, []
        return staged

    def to_host(self, state: Any, name: str) -> Any:
        """The writer's side of a first snapshot: device clones into new pinned buffers, on a stream of its own."""
        if self.device.type != "cuda":
            return state
        buffers = self._buffers.setdefault(name, {})
        stream = torch.cuda.Stream(self.device)

        def move(tensor: torch.Tensor, path: tuple) -> torch.Tensor:
            if tensor.device.type != "cuda":
                return tensor
            buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return buffers[path].copy_(tensor, non_blocking=True)

        with torch.cuda.stream(stream):
            moved = _map_tensors(state, move)
        stream.synchronize()  # before the clones are let go: their memory returns to the training stream
        return moved

    def _snapshot(self, state: Any, name: str) -> Any:
        """``state`` with every tensor copied into this file's host buffer for it (same types around them)."""
        cuda = self.device.type == "cuda"
        buffers = self._buffers.setdefault(name, {})

        def copy(tensor: torch.Tensor, path: tuple) -> torch.Tensor:
            buffer = buffers.get(path)
            if buffer is not None and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype:
                return buffer.copy_(tensor.detach(), non_blocking=cuda)
            if tensor.device.type == "cuda":
                # Pinning host memory costs about a second per GB: the first time, the snapshot is a clone on
                # the device, which the writer moves into new pinned buffers, kept for the next time (to_host).
                return tensor.detach().clone()
            buffers[path] = tensor.detach().clone()
            return buffers[path]

        return _map_tensors(state, copy)


def _map_tensors(obj: Any, fn, path: tuple = ()) -> Any:
    """``obj`` with ``fn(tensor, path)`` for each tensor in its dicts, lists and tuples, their types kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn, (*path, k))) for k, v in obj.items())
    if isinstance(obj, list):
        return [_map_tensors(v, fn, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        items = [_map_tensors(v, fn, (*path, i)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj  # numbers, strings, torch.Size, configs: written as they are


class _HashingFile:
    """A file opened for writing that hashes what goes through it (torch.save writes through ``write``)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


@dataclasses.dataclass
class _Pending:
    """A checkpoint whose files are being written on this rank (and, on rank 0, marked complete)."""

    tag: str
    step: int
    started: float
    blocked_s: float
    write: concurrent.futures.Future
    complete: concurrent.futures.Future | None = None
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    reported: bool = False


class Checkpointer:
    """Checkpoints of one engine: snapshotted by every rank, written in the background, complete once durable."""

    def __init__(self, engine: Any, index: CheckpointIndex, dist: DistEnv, keep: int, writers: dict) -> None:
        self.engine, self.index, self.dist, self.keep, self.writers = engine, index, dist, keep, writers
        self.snapshots = SnapshotEngine(engine.device if hasattr(engine, "device") else torch.device("cpu"))
        # DeepSpeed calls its checkpoint engine for every file it saves (and loads): this one snapshots.
        engine.checkpoint_engine = self.snapshots
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: _Pending | None = None
        self._unreported: list[dict[str, Any]] = []

    # -- saving -----------------------------------------------------------------------
    def save(self, step: int, wait: bool = False) -> None:
        """Snapshot the engine's state on every rank and write it in the background (``wait``: until complete)."""
        tag = self.index.tag(step)
        started = time.perf_counter()
        if self._pending is not None and self._pending.tag == tag:
            if wait:
                self.wait()
            return
        self.wait()  # the previous checkpoint: long finished at any sensible interval
        if self.index.is_complete(tag):
            return
        try:
            self.engine.save_checkpoint(str(self.index.folder), tag=tag, client_state={"step": step}, save_latest=False)
        except (OSError, RuntimeError) as exc:
            self.snapshots.staged = []
            self.index.discard(tag)
            raise CheckpointError(self._failure_line(tag, str(exc))) from None
        files = self.snapshots.take()
        write = self._writer.submit(self._write, tag, files)
        pending = _Pending(tag, step, started, time.perf_counter() - started, write)
        if self.dist.is_main:
            pending.complete = self._writer.submit(self._complete, pending)
        self._pending = pending
        if wait:
            self.wait()

    def _write(self, tag: str, files: list[tuple[Any, str]]) -> int:
        """This rank's files of ``tag``: each hashed as it is written and synced, then the rank's manifest."""
        folder = self.index.path(tag)
        written: dict[str, dict[str, Any]] = {}
        for state, path in files:
            state = self.snapshots.to_host(state, Path(path).name)
            out = _HashingFile(Path(path))
            try:
                torch.save(state, out)
            finally:
                out.close()
            written[str(Path(path).relative_to(folder))] = {"sha256": out.digest.hexdigest(), "bytes": out.size}
        self.index.write_manifest(tag, self.dist.rank, written)
        return sum(f["bytes"] for f in written.values())

    def _complete(self, pending: _Pending) -> dict[str, Any] | None:
        """Rank 0: once every rank's manifest is there, mark ``pending`` complete and prune; its metrics record."""
        pending.write.result()
        while True:
            manifests = self.index.manifests(pending.tag)
            if len(manifests) >= self.dist.world_size:
                break
            if pending.abort.wait(0.05):
                return None
        files = {name: entry for manifest in manifests for name, entry in manifest.items()}
        self.index.mark_complete(pending.tag, pending.step, self.writers, files)
        written_s = time.perf_counter() - pending.started
        self.index.prune(self.keep)
        size = sum(entry["bytes"] for entry in files.values())
        log.info(
            "checkpoint %s saved: training blocked %.2f s, written in %.2f s (%.2f GB) in the background",
            pending.tag,
            pending.blocked_s,
            written_s,
            size / 1e9,
        )
        return {"step": pending.step, "blocked_s": pending.blocked_s, "written_s": written_s, "bytes": size}

    # -- what the loop asks at its window edges ------------------------------------------------
    def write_failed(self) -> bool:
        """Whether this rank's write of the pending checkpoint has failed (not a collective)."""
        p = self._pending
        return p is not None and p.write.done() and p.write.exception() is not None

    def finished(self) -> list[dict[str, Any]]:
        """Rank 0: the metrics records of checkpoints completed since the last call (never blocks)."""
        self._collect()
        records, self._unreported = self._unreported, []
        return records

    def _collect(self) -> None:
        p = self._pending
        if p is None or p.reported or p.complete is None or not p.complete.done() or p.complete.exception():
            return
        p.reported = True
        if p.complete.result() is not None:
            self._unreported.append(p.complete.result())

    def fail(self) -> None:
        """Every rank: a rank's write failed. Agree on the message, drop the partial checkpoint, raise."""
        p = self._pending
        error = p.write.exception() if p is not None and p.write.done() else None
        errors: list[Any] = [None] * self.dist.world_size
        torch.distributed.all_gather_object(errors, str(error) if error else None, group=None)
        if p is not None:
            p.abort.set()
            concurrent.futures.wait([f for f in (p.write, p.complete) if f is not None])
        self._pending = None
        tag = p.tag if p is not None else "?"
        if self.dist.is_main:
            self.index.discard(tag)
        raise CheckpointError(self._failure_line(tag, next(e for e in errors if e)))

    def wait(self) -> None:
        """Every rank together: until the pending checkpoint is complete (its record then waits in finished())."""
        p = self._pending
        if p is None:
            return
        concurrent.futures.wait([p.write])
        if self.dist.world_size > 1:
            failed = torch.tensor([1.0 if self.write_failed() else 0.0], device=collective_device())
            torch.distributed.all_reduce(failed)
            if failed.item():
                self.fail()
        elif self.write_failed():
            self.fail()
        if p.complete is not None:
            p.complete.result()
        self._collect()
        self._pending = None
        if self.dist.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Stop waiting for other ranks (the run is ending on an error) and let the writer finish what it has."""
        if self._pending is not None:
            self._pending.abort.set()
        self._writer.shutdown(wait=True)

    def _failure_line(self, tag: str, error: str) -> str:
        kept = next(iter(self.index.complete()), None)
        intact = (
            f"the last complete checkpoint {kept} is intact: free space and start the job again to resume from it"
            if kept
            else "there is no earlier checkpoint"
        )
        return f"checkpoint {tag} could not be written to {self.index.folder}: {error}; {intact}"

    # -- resuming -------------------------------------------------------------------------
    def load(self, tag: str) -> None:
        """Load checkpoint ``tag`` (chosen and verified once, by the resume plan) on every rank."""
        self.engine.load_checkpoint(str(self.index.folder), tag=tag)
