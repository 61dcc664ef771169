#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-ps
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=3
#SBATCH --cpus-per-task=1
#SBATCH --time=240
#SBATCH --signal=USR2@120
# fmt: on
"""Asynchronous parameter-server training (async, SSP or sync) over torch.distributed.rpc, for ranks that trust
each other (federated training with untrusted clients is jobs/fl_train.py).

    python jobs/ps_train.py --servers 2 --trainers 16 --data.store /lustre/scratch/k400 \\
        --server.mode ssp --cluster mycluster
    sbatch jobs/ps_train.py --servers 1 --data.store ...      # the first --servers tasks serve, the rest train

The run directory has the same layout as jobs/train.py's, so evaluate.py and the registry take it as they are.
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
import os
from typing import Annotated

import tyro

from clipforge.base.logs import setup_logging
from clipforge.hpc.distenv import dist_env, share_cores
from clipforge.hpc.launch import JobSpec, Launch, context, run_script
from clipforge.hpc.resources import Resources
from clipforge.jobs import config
from clipforge.ps import run as ps
from clipforge.ps.run import PSSettings
from clipforge.rundir import RunDir


@dataclasses.dataclass
class Config(PSSettings):
    """Parameter-server training on a clip store."""

    trainers: int = 2
    """Trainer ranks; with --servers this sets the job's task count."""
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(time="04:00:00", job_name="clipforge-ps")
    )


def parse(argv: list[str] | None = None) -> Config:
    cfg = config.parse(Config, argv)
    tasks = cfg.servers + cfg.trainers
    if tasks % cfg.resources.nodes:
        raise config.ConfigError(
            f"{cfg.servers} servers + {cfg.trainers} trainers do not spread evenly over {cfg.resources.nodes} nodes"
        )
    cfg.resources.ntasks_per_node = tasks // cfg.resources.nodes
    return cfg


def check(cfg: Config) -> None:
    """Refuse a job that cannot work before anything is submitted."""
    tasks, given = cfg.servers + cfg.trainers, int(os.environ.get("SLURM_NTASKS", 1))
    if context() in ("batch", "allocation") and given != tasks:
        # Inside sbatch or salloc the allocation's tasks are the ranks: every task after the servers trains.
        raise config.ConfigError(
            f"--servers {cfg.servers} --trainers {cfg.trainers} make {tasks} tasks, and this allocation has {given}: "
            f"give --trainers {given - cfg.servers}, or ask sbatch or salloc for {tasks} tasks (e.g. "
            f"--ntasks-per-node {tasks})"
        )
    if cfg.resources.gpus_per_node:
        raise config.ConfigError(
            f"--gpus-per-node {cfg.resources.gpus_per_node}: the parameter server and its trainers run on CPUs; "
            "leave it out"
        )
    ps.check(cfg, tasks)


def main(cfg: Config) -> dict | None:
    env = dist_env()
    share_cores()
    setup_logging(env.rank)
    if env.rank == 0:
        RunDir(cfg.run_dir).write_config(config.to_dict(cfg))
    return ps.run(cfg, env)


SPEC = JobSpec("clipforge.jobs.ps_train", parse, main, check=check, survives_lost_ranks=True)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
