#!/usr/bin/env python3
# fmt: off
#SBATCH --job-name=clipforge-selftest
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=10
#SBATCH --signal=USR2@60
# fmt: on
"""Cluster self-test: is this cluster ready for clipforge?

Every rank derives its distributed environment through the ``hpc`` contract,
joins a gloo process group and all-reduces its rank; then, if asked, it counts
steps with its state on disk, so requeue and timeout behaviour can be seen.

    python jobs/selftest.py --ntasks-per-node 2            # local processes
    python jobs/selftest.py --cluster dev --ntasks-per-node 2 --wait True
    sbatch jobs/selftest.py --steps 30 --state-dir /scratch/selftest
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
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import tyro

from clipforge.base.files import write_json
from clipforge.base.logs import setup_logging
from clipforge.hpc.distenv import init_process_group, setup_distributed
from clipforge.hpc.launch import JobSpec, Launch, run_script
from clipforge.hpc.requeue import on_requeue
from clipforge.hpc.resources import Resources
from clipforge.jobs import config

log = logging.getLogger("clipforge.selftest")


@dataclasses.dataclass
class Config:
    """Check that ranks, the process group and requeue work on this cluster."""

    steps: int = 0
    """Steps to count after the all-reduce (0: stop after it)."""
    step_seconds: float = 1.0
    """Seconds each step takes."""
    state_dir: Path | None = None
    """Where the step counter is kept so that a requeued job resumes; needed when steps > 0."""
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=Launch)
    resources: Annotated[Resources, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=lambda: Resources(
            ntasks_per_node=2, time="00:10:00", signal_delay_s=60, job_name="clipforge-selftest"
        )
    )


def parse(argv: list[str] | None = None) -> Config:
    cfg = config.parse(Config, argv)
    if cfg.steps > 0 and cfg.state_dir is None:
        raise config.ConfigError("--state-dir is needed with --steps, so that a requeued job can resume")
    return cfg


def main(cfg: Config) -> dict:
    env = setup_distributed()
    setup_logging(env.rank)
    init_process_group(env, torch.device("cpu"), single=True, timeout_s=120)  # gloo: the CPU path is the check
    try:
        value = torch.tensor([env.rank + 1.0])
        dist.all_reduce(value)
        log.info(
            "rank %d of %d (local rank %d) on %s, master %s:%d: all_reduce gave %g (source %s)",
            env.rank,
            env.world_size,
            env.local_rank,
            socket.gethostname(),
            env.master_addr,
            env.master_port,
            value.item(),
            env.source,
        )
        start = step = _load_step(cfg.state_dir)
        if start:
            log.info("resuming at step %d after %d requeue(s)", start, env.restart_count)
        if env.is_main:
            on_requeue(lambda: _save_step(cfg.state_dir, step, env.restart_count))
        while step < cfg.steps:
            time.sleep(cfg.step_seconds)
            step += 1
            if env.is_main:
                _save_step(cfg.state_dir, step, env.restart_count)
            if step % 10 == 0 or step == cfg.steps:
                log.info("step %d/%d", step, cfg.steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "master_addr": env.master_addr,
        "master_port": env.master_port,
        "job_id": env.job_id,
        "source": env.source,
        "restart_count": env.restart_count,
        "all_reduce": value.item(),
        "threads": torch.get_num_threads(),
        "start_step": start,
        "final_step": step,
        "environ": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
    }


def _load_step(state_dir: Path | None) -> int:
    if state_dir is None or not (state_dir / "state.json").exists():
        return 0
    return int(json.loads((state_dir / "state.json").read_text())["step"])


def _save_step(state_dir: Path | None, step: int, restarts: int) -> None:
    if state_dir is None:
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    write_json(state_dir / "state.json", {"step": step, "restart_count": restarts})  # a kill never leaves half a state


SPEC = JobSpec("clipforge.jobs.selftest", parse, main)

if __name__ == "__main__":
    sys.exit(config.guarded(lambda: run_script(SPEC.module))())
