"""mpi4py over a real MPI, launched by mpiexec and by srun."""

from __future__ import annotations

import subprocess
import sys

import pytest

WORLD = "from mpi4py import MPI; print('world', MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), flush=True)"
CHECKED = (
    "from mpi4py import MPI; from clipforge.hpc.distenv import check_mpi_world; "
    "check_mpi_world(MPI.COMM_WORLD.Get_size())"
)


@pytest.mark.mpi
def test_mpiexec_gives_a_world_of_two(mpiexec) -> None:
    result = subprocess.run(
        [*mpiexec, "-n", "2", sys.executable, "-c", WORLD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["world 0 2", "world 1 2"]


@pytest.mark.mpi
@pytest.mark.slurm
def test_srun_gives_a_world_of_two(slurm) -> None:
    result = subprocess.run(
        ["srun", "-n", "2", sys.executable, "-c", WORLD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["world 0 2", "world 1 2"]


@pytest.mark.mpi
@pytest.mark.slurm
def test_srun_without_pmi_is_detected_instead_of_running_separate_worlds(slurm) -> None:
    result = subprocess.run(
        ["srun", "--mpi=none", "-n", "2", sys.executable, "-c", CHECKED], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Slurm started 2 tasks but MPI sees a world of 1" in result.stderr
