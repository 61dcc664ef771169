"""mpi4py over a real MPI, launched by mpiexec and by srun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.hpc.mpi import mca_settings

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


def test_osc_ucx_is_left_out_only_on_hosts_without_rdma_devices(tmp_path: Path) -> None:
    # The kernel's device list is a folder; an InfiniBand adapter cannot be added to this host, so a copy stands in.
    devices = tmp_path / "infiniband"
    devices.mkdir()
    assert mca_settings(devices, environ={}) == {"OMPI_MCA_osc": "^ucx"}
    assert mca_settings(tmp_path / "absent", environ={}) == {"OMPI_MCA_osc": "^ucx"}
    (devices / "mlx5_0").mkdir()
    assert mca_settings(devices, environ={}) == {}  # InfiniBand or RoCE: UCX's one-sided path stays
    assert mca_settings(tmp_path / "absent", environ={"OMPI_MCA_osc": "ucx"}) == {}  # the user's choice stands
