#!/usr/bin/env python3
"""Scale on one host: the same training job on one node and spread over N, and the loss of a node.

    python -m clipforge.jobs.bench.nodes [--nodes 3 --tasks-per-node 2 --repeats 3]

Starts an (N+1)-node cluster beside the default one (``LocalCluster.beside``),
writes a small rendered clip store, then, alternating the two sides in every
repeat, trains the same job (same world size, ZeRO-2) as 1 node x N*T tasks
and as N nodes x T tasks, and reports:

- start-up: from ``sbatch`` to the first optimizer step;
- checkpoint: the time to write one (every rank, then the completion mark);
- steps/s once running;
- restart: from the event to the first step after the resume: on N nodes a
  node crashed after the first checkpoint (Slurm must notice, mark it down
  and requeue; the job then runs on the cluster's spare node), on one node
  ``scontrol requeue`` at the same point (the peer: the same restart without
  a failure to detect).

Figures are medians over the repeats; ratios are N nodes over 1 node, the
median of the paired ratios with their min-max.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tyro

from clipforge.hpc.devcluster import LocalCluster
from clipforge.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY = 30, 10


@dataclasses.dataclass
class Config:
    """Time start-up, checkpoints and restarts of a training job on 1 node and on N nodes."""

    nodes: int = 3
    """Nodes of the spread-out side."""
    tasks_per_node: int = 2
    """Tasks per node on that side (the 1-node side runs nodes x tasks_per_node tasks)."""
    repeats: int = 3
    """Pairs of runs."""


def main(cfg: Config) -> None:
    # One node more than the job spans: after a node loss the requeued job runs on the others at once.
    cluster = LocalCluster.beside(cfg.nodes + 1)
    cluster.up()
    try:
        run_pairs(cfg, cluster)
    finally:
        cluster.down()  # its namespaces would stand in the way of the test suite's cluster


def run_pairs(cfg: Config, cluster: LocalCluster) -> None:
    env = {**os.environ, **cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    work = Path(tempfile.mkdtemp(prefix="clipforge-bench-nodes-"))
    from clipforge.preprocess import synthetic

    store = synthetic.write_store(work / "store", videos_per_class=6, clip_frames=8, size=32)
    world = cfg.nodes * cfg.tasks_per_node
    sides = {"one": (1, world), "many": (cfg.nodes, cfg.tasks_per_node)}
    figures: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for repeat in range(cfg.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for side in order:
            nodes, tasks = sides[side]
            run = work / f"{side}-{repeat}"
            for key, value in measure(cluster, env, store, run, nodes, tasks, side == "many").items():
                figures[side].setdefault(key, []).append(value)
            print(f"repeat {repeat + 1}/{cfg.repeats}, {nodes} node(s) x {tasks}: done", file=sys.stderr, flush=True)
    report(cfg, figures, world)


def measure(
    cluster: LocalCluster, env: dict[str, str], store: Path, run: Path, nodes: int, tasks: int, kill: bool
) -> dict[str, float]:
    argv = ["sbatch", "--parsable", "--requeue", "--open-mode=append", f"-N{nodes}", f"--ntasks-per-node={tasks}"]
    argv += [f"--output={run}.out", str(REPO / "jobs" / "train.py"), "--data.store", str(store), "--run-dir", str(run)]
    argv += ["--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--eval-every", "1000"]
    argv += ["--model.name", "videovit-tiny", "--model.depth", "2", "--model.tubelet", "2", "8", "8"]
    argv += ["--batch-per-rank", "2", "--data.workers", "0", "--parallel.zero-stage", "2"]
    submitted = time.time()
    job = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    checkpoints = RunDir(run).checkpoints
    while not checkpoints.is_complete(checkpoints.tag(CHECKPOINT_EVERY)):
        time.sleep(0.05)
    event = time.time()
    victim = None
    if kill:
        held = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True, env=env).stdout
        hosts = subprocess.run(["scontrol", "show", "hostnames", held.strip()], capture_output=True, text=True, env=env)
        victim = hosts.stdout.split()[-1]  # the last node of the job, never its batch host
        cluster.kill_node(victim)
    else:
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env).stdout.strip():
        time.sleep(0.5)
    if victim is not None:
        # Only now: a node that returns while its job's next run starts is told to kill "its" old job, by id.
        cluster.start_node(victim)
        while "idle" not in sinfo(victim, env):
            time.sleep(0.5)
    records = RunDir(run).metrics()
    steps = [r for r in records if r["kind"] == "train"]
    first = steps[0]["time"]
    after = [r for r in steps if r["time"] > event]
    # Steps after the event may still be the first attempt's; the resume is where the step number goes back.
    resumed = next((b for a, b in zip(after, after[1:]) if b["step"] <= a["step"]), after[0])
    steady = [r for r in after if r["step"] > resumed["step"]]
    # The background write's time, as the checkpoint line reports it ("... written in 0.10 s (0.01 GB) ...").
    saves = [float(x) for x in re.findall(r"written in ([0-9.]+) s", Path(f"{run}.out").read_text())]
    return {
        "start-up to first step (s)": first - submitted,
        "checkpoint write (s)": statistics.median(saves),
        "steps/s": (len(steady) - 1) / max(steady[-1]["time"] - steady[0]["time"], 1e-9),
        "restart to resumed step (s)": resumed["time"] - event,
    }


def sinfo(node: str, env: dict[str, str]) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, env=env).stdout


def report(cfg: Config, figures: dict[str, dict[str, list[float]]], world: int) -> None:
    one, many = figures["one"], figures["many"]
    print(
        f"\nvideovit-tiny ZeRO-2, world size {world}, {STEPS} steps, a checkpoint every {CHECKPOINT_EVERY}; "
        f"{cfg.repeats} pairs, alternating\n"
    )
    label = f"{cfg.nodes} nodes x {cfg.tasks_per_node}"
    print(f"{'figure':<30} {'1 node x ' + str(world):>12} {label:>14} {'ratio':>7}  {'min-max':>11}")
    for key in one:
        ratios = [b / a for a, b in zip(one[key], many[key]) if a > 0]
        print(
            f"{key:<30} {statistics.median(one[key]):12.2f} {statistics.median(many[key]):14.2f} "
            f"{statistics.median(ratios):6.2f}x  {min(ratios):.2f}-{max(ratios):.2f}x"
        )
    print(
        "\nrestart: on 1 node `scontrol requeue` after the first checkpoint (the peer); on "
        f"{cfg.nodes} nodes a node crashed at the same point (link cut, its processes killed: Slurm detects it, marks "
        "it down, requeues, and the job runs on the spare node)"
    )


if __name__ == "__main__":
    main(tyro.cli(Config))
