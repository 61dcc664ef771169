"""``clipforge demo``: the main job on the embedded default (the job itself is ``clipforge.jobs.demo``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_to(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="run the main job on the embedded default (no cluster needed)")
    demo.add_argument("--cluster", default=None, help="a cluster profile to run on instead of local processes")
    demo.add_argument("--workdir", default="runs/demo", help="where the demo corpus, store and runs go")
    demo.set_defaults(func=_run)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    # Imported when it runs: the demo loads torch and the registry, which the other commands do without.
    from clipforge.jobs.demo import run

    return run(cluster=args.cluster, workdir=Path(args.workdir))
