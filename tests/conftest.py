"""Shared fixtures: a real single-node Slurm cluster, isolated job folders."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from clipforge.hpc.cluster import LocalCluster

VENV_BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="session")
def slurm() -> LocalCluster:
    """The local Slurm cluster, started if it is not running (it is left running for the next run)."""
    cluster = LocalCluster()
    if not cluster.is_up():
        cluster.up()
    os.environ.update(cluster.env)
    # Batch scripts start `python3` from PATH: make it this virtual environment's.
    os.environ["PATH"] = f"{VENV_BIN}:{os.environ['PATH']}"
    return cluster


@pytest.fixture(autouse=True)
def jobs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's submitit job folders live in its own temporary directory."""
    folder = tmp_path / "jobs"
    monkeypatch.setenv("CLIPFORGE_JOBS_DIR", str(folder))
    return folder


@pytest.fixture
def mpiexec() -> list[str]:
    """The MPI launcher that came with the openmpi package, with what root and oversubscription need."""
    path = shutil.which("mpiexec", path=VENV_BIN) or shutil.which("mpiexec")
    assert path, "mpiexec is missing: the openmpi package should provide it (./dev.sh setup)"
    return [path, "--allow-run-as-root", "--oversubscribe"]

