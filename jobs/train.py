#!/usr/bin/env python3
#SBATCH --job-name=clipforge-train
#SBATCH --ntasks=2
#SBATCH --time=04:00:00
#SBATCH --signal=USR2@120
"""Train a video classifier with DeepSpeed (ZeRO 0-3, pipeline stages) on the clip store.

    python jobs/train.py --config jobs/configs/videovit_tiny.yaml --cluster mycluster --nodes 8 --gpus-per-node 4 --ntasks-per-node 4
    sbatch jobs/train.py --config jobs/configs/videovit_tiny.yaml
    salloc -n 2; python jobs/train.py --config ...        # in the foreground, under srun

A run resumes from its last complete checkpoint in --run-dir whenever it starts again.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Annotated

import tyro
import yaml

from clipforge.hpc.distenv import dist_env
from clipforge.hpc.launch import Launch, run_script
from clipforge.hpc.logs import setup_logging
from clipforge.hpc.profile import load_profile
from clipforge.hpc.resources import Resources
from clipforge.jobs import config
from clipforge.models.trainer import CheckpointError, TrainError, Trainer, TrainSettings, check_settings

log = logging.getLogger("clipforge.train")


@dataclasses.dataclass
class Config(TrainSettings):
    """Train a video classifier on a clip store."""

    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(ntasks_per_node=2, time="04:00:00", job_name="clipforge-train")
    )


def parse(argv: list[str] | None = None) -> Config:
    return config.parse(Config, argv)


def check(cfg: Config) -> None:
    """Refuse a run that cannot work before anything is submitted."""
    try:
        check_settings(cfg, cfg.resources.ntasks)
    except TrainError as exc:
        raise config.ConfigError(str(exc)) from None


def main(cfg: Config) -> dict | None:
    env = dist_env()
    setup_logging(env.rank)
    try:
        bound = cfg.launch.max_requeues if cfg.launch.max_requeues is not None else load_profile(cfg.launch.cluster).max_requeues
        trainer = Trainer(cfg, max_requeues=bound)
    except TrainError as exc:
        raise config.ConfigError(str(exc)) from None
    if env.rank == 0:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg), sort_keys=False))
    try:
        result = trainer.train()
    except CheckpointError as exc:
        logging.getLogger("clipforge.train").error("%s", exc)
        raise SystemExit(1) from None
    return result if env.rank == 0 else None


if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script("clipforge.jobs.train"))())
