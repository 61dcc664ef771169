"""Launching MPI ranks where Slurm does not: ``mpiexec`` with the flags this host needs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
