"""MPI for clipforge's ranks: ``mpiexec`` with the flags this host needs, and shared work in one-sided windows.

:func:`mpi` is how every rank imports mpi4py. :class:`WorkList` and :class:`Counters` hand work out
without a dispatcher rank: the list and the counters stay in rank 0's memory, and each rank reads
and increments them with one-sided calls.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .distenv import LaunchError

RDMA_DEVICES = Path("/sys/class/infiniband")
"""Where the kernel lists InfiniBand, RoCE and Omni-Path adapters (the devices UCX drives)."""


def mca_settings(devices: Path = RDMA_DEVICES, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Open MPI settings for this host, to set before ``MPI_Init``.

    Open MPI 5 asks its UCX one-sided component (osc/ucx) first. On a host without an
    RDMA adapter UCX has no transport for it, and the component prints two ``Error:``
    lines into every log before Open MPI falls back to its own one-sided code, which
    then works. So osc/ucx is left out only where the kernel lists no RDMA device. On an
    InfiniBand or RoCE node it stays: it is the fast path for the packing work list's
    MPI_Get. A setting the user made (``OMPI_MCA_osc``) is never overridden.
    """
    env = os.environ if environ is None else environ
    if "OMPI_MCA_osc" in env:
        return {}
    try:
        has_rdma = any(devices.iterdir())
    except OSError:
        has_rdma = False
    return {} if has_rdma else {"OMPI_MCA_osc": "^ucx"}


def mpi():
    """mpi4py's ``MPI`` module, initialised with :func:`mca_settings` (every rank imports MPI through this)."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.update(mca_settings())
    from mpi4py import MPI

    return MPI


def mpiexec_command(ntasks: int) -> list[str]:
    """``mpiexec ... -n N`` for the MPI that mpi4py uses."""
    return [*mpiexec_prefix(), "-n", str(ntasks)]


def mpiexec_prefix() -> list[str]:
    """``mpiexec`` with Open MPI's flags where they are needed.

    Open MPI refuses root without --allow-run-as-root, more ranks than cores
    without --oversubscribe, and pins ranks to cores (which piles them onto one
    core inside an allocation) without --bind-to none. MPICH needs none of these.
    """
    exe = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if exe is None:
        raise LaunchError("mpiexec not found: install an MPI (the openmpi Python package provides one)")
    command = [exe]
    if _is_open_mpi(exe):
        command += ["--bind-to", "none", "--oversubscribe"]
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
    return command


@functools.cache
def _is_open_mpi(exe: str) -> bool:
    result = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return "Open MPI" in result.stdout + result.stderr or "prterun" in result.stdout + result.stderr


class WorkList:
    """A list of work items held in rank 0's memory; a rank reads an item when it takes it (``MPI_Get``).

    An item is a few integers and one string (for packing: video id, label index, path); every item has
    the same number of integers. No rank receives the list: a million items are a few dozen MB on rank 0
    and, on every other rank, only the items it reads. Every rank of ``comm`` constructs it (rank 0 with
    the items, the others with None) and calls :meth:`free`.
    """

    def __init__(self, comm, items: Sequence[tuple[int | str, ...]] | None) -> None:
        MPI = mpi()

        self.MPI = MPI
        root = comm.rank == 0
        texts = [str(item[-1]).encode() for item in items] if root else []
        width = len(items[0]) - 1 if root and items else 0
        self.n, self.width = comm.bcast((len(texts), width) if root else None, root=0)
        nbytes = sum(map(len, texts))
        # Per item: its integers, then where its text starts in the text window and how long it is.
        self.records = MPI.Win.Allocate(self.n * (self.width + 2) * 8 if root else 0, 8, comm=comm)
        self.texts = MPI.Win.Allocate(max(nbytes, 1) if root else 0, 1, comm=comm)
        if root and self.n:
            records = np.frombuffer(self.records.tomemory(), dtype=np.int64).reshape(self.n, self.width + 2)
            lengths = np.array([len(t) for t in texts], np.int64)
            records[:, : self.width] = [item[:-1] for item in items]
            records[:, -2] = np.cumsum(lengths) - lengths
            records[:, -1] = lengths
            np.frombuffer(self.texts.tomemory(), dtype=np.uint8)[:nbytes] = np.frombuffer(b"".join(texts), np.uint8)
        comm.Barrier()

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> tuple[int | str, ...]:
        """Item ``i``, as rank 0 gave it: its integers, then its string."""
        MPI = self.MPI
        size = self.width + 2
        record = np.empty(size, np.int64)
        self.records.Lock(0, MPI.LOCK_SHARED)
        self.records.Get(record, 0, target=(i * size, size, MPI.INT64_T))
        self.records.Unlock(0)
        text = np.empty(int(record[-1]), np.uint8)
        self.texts.Lock(0, MPI.LOCK_SHARED)
        self.texts.Get(text, 0, target=(int(record[-2]), len(text), MPI.BYTE))
        self.texts.Unlock(0)
        return (*(int(x) for x in record[: self.width]), text.tobytes().decode())

    def free(self) -> None:
        self.records.Free()
        self.texts.Free()


class Counters:
    """Integer counters in rank 0's memory that every rank updates with one-sided atomics (``MPI_Fetch_and_op``).

    Every rank of ``comm`` constructs it with the same number of ``initial`` values (rank 0's are the
    ones kept) and calls :meth:`free`. A counter is addressed by its position in ``initial``.
    """

    def __init__(self, comm, initial: Sequence[int]) -> None:
        MPI = mpi()

        self.MPI = MPI
        self.win = MPI.Win.Allocate(len(initial) * 8 if comm.rank == 0 else 0, 8, comm=comm)
        if comm.rank == 0:
            np.frombuffer(self.win.tomemory(), dtype=np.int64)[:] = initial
        comm.Barrier()
        self._one = np.zeros(1, np.int64)
        self._out = np.zeros(1, np.int64)

    def fetch_add(self, slot: int, amount: int = 1) -> int:
        """Add ``amount`` to counter ``slot``; returns its value before the addition."""
        self._one[0] = amount
        self.win.Lock(0, self.MPI.LOCK_SHARED)
        self.win.Fetch_and_op(self._one, self._out, 0, slot, self.MPI.SUM)
        self.win.Unlock(0)
        return int(self._out[0])

    def read(self, slot: int) -> int:
        """The value of counter ``slot`` now."""
        self.win.Lock(0, self.MPI.LOCK_SHARED)
        self.win.Fetch_and_op(self._one, self._out, 0, slot, self.MPI.NO_OP)
        self.win.Unlock(0)
        return int(self._out[0])

    def free(self) -> None:
        self.win.Free()
