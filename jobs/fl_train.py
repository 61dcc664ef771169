#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-fl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=3
#SBATCH --time=240
# fmt: on
"""Federated training on Flower: a server and clients that train on data that never leaves them.

    python jobs/fl_train.py --data.store store/ucf101 --clients 4 --rounds 20     # a SuperLink and 4 SuperNodes
    sbatch jobs/fl_train.py --data.store ... --clients 4 --cpus-per-task 5        # the same, as one Slurm task
    python jobs/fl_train.py --data.store ... --clients 4 --nodes 5 --cluster mycluster  # a task per client

With one task per client plus one (--nodes, --ntasks-per-node), the first task
runs the SuperLink and the ServerApp, serving TLS on its node at the job's port,
and each other task runs one client's SuperNode, wherever Slurm put it; a lost
node's clients are left out of the round after --round-timeout-s.

The server is Flower's SuperLink behind a gate (mutual TLS, the Fleet API only);
it checks and weighs every update itself (docs/federated.md has the threat model);
with --outside N the last N clients are sites elsewhere that join with
`clipforge fl join`. The run directory is the one every run writes:
config, a metrics row per round, the global model after each round (a killed
server resumes from its last round), final weights and record.
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
from clipforge.hpc.distenv import dist_env, share_cores
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.resources import Resources
from clipforge.jobs import config, start_weights
from clipforge.ps import federation
from clipforge.rundir import RunDir

log = logging.getLogger("clipforge.fl_train")


@dataclasses.dataclass
class Config(federation.FederationSettings):
    """Federated training of a video classifier on Flower, with TLS and authenticated clients."""

    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(time="04:00:00", job_name="clipforge-fl")
    )


def parse(argv: list[str] | None = None) -> Config:
    return config.parse(Config, argv)


def check(cfg: Config) -> None:
    """Refuse a federation that cannot work before anything starts."""
    start_weights.adopt(cfg.model)  # a registry version's architecture, or a finished run's or imported model's
    federation.check(cfg, cfg.resources.ntasks, cfg.resources.gpus_per_node)


def starting_weights(cfg: Config, run: RunDir) -> Path | None:
    """The weights file the federation starts from: ``--model.weights`` (its architecture adopted), a registry
    version's copied into the run directory first (once: a restarted server finds it there)."""
    source = cfg.model.weights
    if source is None:
        return None
    start_weights.adopt(cfg.model)
    if cfg.model.registry_reference() is not None:
        return start_weights.fetch_registry_weights(cfg.model, run.start_weights)
    log.info("the federation starts from %s", source)
    return Path(cfg.model.weights)


def main(cfg: Config) -> dict | None:
    env = dist_env()
    share_cores(ranks=cfg.clients if env.world_size == 1 else None)  # the clients' processes inherit the threads
    setup_logging(env.rank if env.world_size > 1 else None)

    def ready(run: RunDir) -> Path | None:
        start = starting_weights(cfg, run)
        run.write_config(config.to_dict(cfg))  # with the architecture the starting weights brought
        return start

    return federation.serve(cfg, env, ready)


SPEC = JobSpec("clipforge.jobs.fl_train", parse, main, check=check, survives_lost_ranks=True)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
