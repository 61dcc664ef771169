#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=240
#SBATCH --signal=USR2@120
# fmt: on
"""Train a video classifier with DeepSpeed (ZeRO 0-3, pipeline stages) on the clip store.

    python jobs/train.py --config jobs/configs/k400_train.yaml --data.store /lustre/scratch/k400 \\
        --cluster mycluster --nodes 8 --gpus-per-node 4 --ntasks-per-node 4
    sbatch jobs/train.py --config jobs/configs/ucf101_train.yaml --data.store store/ucf101
    salloc -n 2; python jobs/train.py --config ...        # in the foreground, under srun

A run resumes from its last complete checkpoint in --run-dir whenever it starts again.
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
import functools
import logging
from typing import Annotated

import tyro

from clipforge.base.logs import setup_logging
from clipforge.hpc.distenv import dist_env
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.resources import Resources
from clipforge.jobs import config
from clipforge.jobs.start_weights import fetch_registry_weights, registry_architecture
from clipforge.rundir import RunDir
from clipforge.train.checkpointing import CheckpointError
from clipforge.train.settings import TrainSettings, resolve_settings
from clipforge.train.trainer import Trainer

log = logging.getLogger("clipforge.train")


@dataclasses.dataclass
class Config(TrainSettings):
    """Train a video classifier on a clip store."""

    elastic_min_nodes: int | None = None
    """Allow a requeued run to resume on as few as this many nodes after a node loss (ZeRO 0-2 data parallel):
    the job asks Slurm for --nodes MIN-MAX and keeps the global batch by raising gradient accumulation."""
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(ntasks_per_node=2, time="04:00:00", job_name="clipforge-train")
    )


def parse(argv: list[str] | None = None) -> Config:
    cfg = config.parse(Config, argv)
    if cfg.elastic_min_nodes is not None:
        if cfg.resources.min_nodes not in (None, cfg.elastic_min_nodes):
            raise config.ConfigError(
                f"--min-nodes {cfg.resources.min_nodes} with --elastic-min-nodes {cfg.elastic_min_nodes}: the job asks "
                "Slurm for --elastic-min-nodes; give one of them"
            )
        cfg.resources.min_nodes = cfg.elastic_min_nodes
    return cfg


def check(cfg: Config) -> None:
    """Refuse a run that cannot work before anything is submitted."""
    if cfg.model.registry_reference() is not None:
        model, overrides = registry_architecture(cfg.model)  # the version exists, and its architecture is this run's
        cfg.model.adopt(model, overrides, str(cfg.model.weights))
    resolve_settings(cfg, cfg.resources.ntasks)
    if cfg.elastic_min_nodes is not None and (cfg.parallel.layout != "plain" or cfg.parallel.zero_stage == 3):
        raise config.ConfigError(
            "--elastic-min-nodes: a restart on fewer nodes reshards ZeRO 0-2 data parallel only; a pipeline needs "
            "its stages and ZeRO-3 its partitions"
        )


def main(cfg: Config) -> dict | None:
    env = dist_env()
    setup_logging(env.rank)
    from_registry = cfg.model.registry_reference() is not None
    trainer = Trainer(
        cfg,
        max_requeues=cfg.launch.requeues(),
        elastic=cfg.elastic_min_nodes is not None,
        fetch_weights=functools.partial(fetch_registry_weights, cfg.model) if from_registry else None,
        start_architecture=functools.partial(registry_architecture, cfg.model) if from_registry else None,
    )
    if env.rank == 0:
        RunDir(cfg.run_dir).write_config(config.to_dict(cfg))
    try:
        result = trainer.train()
    except CheckpointError as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None
    return result if env.rank == 0 else None


SPEC = JobSpec("clipforge.jobs.train", parse, main, check=check)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
