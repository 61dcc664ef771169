"""Launching MPI ranks where Slurm does not: ``mpiexec`` with the flags this host needs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .distenv import LaunchError


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
