"""The main job on the embedded default: what ``clipforge demo`` runs.

With no cluster it runs on submitit's local executor; ``--cluster dev`` runs
the same stages as Slurm jobs on the local single-node cluster. Stages are
added here as the rooms land; today: the cluster self-test with 2 ranks.
"""

from __future__ import annotations

import logging

from clipforge.hpc.launch import run_script

log = logging.getLogger("clipforge.demo")


def run(cluster: str | None = None) -> int:
    argv = ["--ntasks-per-node", "2", "--wait", "True"]
    if cluster:
        argv += ["--cluster", cluster]
    log.info("stage 1/1: cluster self-test, 2 ranks, gloo all_reduce")
    results = run_script("clipforge.jobs.selftest", argv)
    ok = sorted(r["rank"] for r in results) == [0, 1] and all(r["all_reduce"] == 3.0 for r in results)
    for r in results:
        print(f"  rank {r['rank']}/{r['world_size']} via {r['source']}: all_reduce={r['all_reduce']:g} "
              f"MASTER_ADDR={r['master_addr']} MASTER_PORT={r['master_port']}")
    print(f"demo: {'OK' if ok else 'FAILED'}: 2 ranks joined one process group through the hpc layer")
    return 0 if ok else 1
