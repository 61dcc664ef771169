"""``clipforge cluster up|down|status|env``: the Slurm cluster on this host."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from clipforge.hpc.devcluster import LocalCluster


def _up(cluster: LocalCluster) -> int:
    cluster.up()
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


def _down(cluster: LocalCluster) -> int:
    cluster.down()
    return 0


def _status(cluster: LocalCluster) -> int:
    for daemon, running in cluster.status().items():
        print(f"{daemon:10s} {'running' if running else 'stopped'}")
    return 0 if cluster.is_up() else 1


def _env(cluster: LocalCluster) -> int:
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


ACTIONS: dict[str, Callable[[LocalCluster], int]] = {"up": _up, "down": _down, "status": _status, "env": _env}


def add_to(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser("cluster", help="start, stop or inspect the Slurm cluster on this host (--nodes N)")
    cluster.add_argument("action", choices=list(ACTIONS))
    cluster.add_argument("--no-accounting", action="store_true", help="skip slurmdbd and MariaDB (sacct will not work)")
    cluster.add_argument(
        "--nodes", type=int, help="up: 1 (default), this host is the node; 2-9: nodes n1..nN in network namespaces"
    )
    cluster.add_argument("--subnet", default="10.77.0", help="the nodes' /24 when there are several (default 10.77.0)")
    cluster.set_defaults(func=_run)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    # down, status and env act on the cluster as it was brought up.
    nodes = args.nodes or (1 if args.action == "up" else LocalCluster().recorded_nodes())
    return ACTIONS[args.action](LocalCluster(accounting=not args.no_accounting, nodes=nodes, subnet=args.subnet))
