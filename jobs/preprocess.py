#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-preprocess
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=120
#SBATCH --signal=USR2@120
# fmt: on
"""Pack a video corpus into an HDF5 clip store, one MPI rank per Slurm task.

    python jobs/preprocess.py --videos /lustre/k400 --out /lustre/scratch/k400 \\
        --cluster mycluster --nodes 4 --ntasks-per-node 32
    sbatch jobs/preprocess.py --videos /lustre/k400 --out /lustre/scratch/k400
    mpiexec -n 4 python jobs/preprocess.py --videos ./videos --out ./store

Rerunning the same command on the same --out does only what is missing.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # sbatch runs the first python3 on PATH: say so in one line if it lacks clipforge
    try:
        import clipforge.hpc.launch  # noqa: F401
    except ImportError as missing:
        sys.exit(
            f"clipforge: error: {sys.executable} cannot run this job ({missing}); activate the environment clipforge "
            "is installed in (source <venv>/bin/activate) before python or sbatch, which passes it on to the job"
        )

import dataclasses
import logging
from pathlib import Path
from typing import Annotated

import tyro

from clipforge.base.logs import setup_logging
from clipforge.hpc.distenv import check_mpi_world, dist_env
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.mpi import mpi
from clipforge.hpc.resources import Resources
from clipforge.jobs import config
from clipforge.preprocess.corpus import SplitRatios
from clipforge.preprocess.decode import ClipParams
from clipforge.preprocess.pack import pack_corpus
from clipforge.preprocess.preflight import PackOptions, preflight

log = logging.getLogger("clipforge.preprocess")


@dataclasses.dataclass
class Config:
    """Pack videos into an HDF5 clip store."""

    videos: Path = Path("videos")
    """A class-per-folder corpus (root/<class>/<video>) or a .csv/.jsonl manifest (path,label[,split])."""
    out: Path = Path("store")
    """The clip store directory (on Lustre: a scratch path)."""
    clip: Annotated[ClipParams, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=ClipParams)
    pack: Annotated[PackOptions, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=PackOptions)
    split: SplitRatios = dataclasses.field(default_factory=SplitRatios)
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(ntasks_per_node=2, time="02:00:00", job_name="clipforge-preprocess")
    )


def parse(argv: list[str] | None = None) -> Config:
    return config.parse(Config, argv)


def check(cfg: Config) -> None:
    """Refuse, before anything is submitted, a corpus, clip parameters or output that cannot work."""
    preflight(cfg.videos, cfg.out, cfg.clip, cfg.pack)


def main(cfg: Config) -> dict | None:
    setup_logging(dist_env().rank)
    check_mpi_world(mpi().COMM_WORLD.Get_size())
    summary = pack_corpus(cfg.videos, cfg.out, cfg.clip, cfg.pack, cfg.split)
    return None if summary is None else dataclasses.asdict(summary)


SPEC = JobSpec("clipforge.jobs.preprocess", parse, main, check=check, uses_mpi=True)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
