"""``clipforge``: one command line over the rooms.

clipforge cluster up|down|status|env     a Slurm cluster on this host (--nodes N: N nodes)
clipforge jobs run NAME [ARGS]           run a job module (selftest, ...)
clipforge jobs list|status|logs|cancel   jobs submitted through clipforge
clipforge jobs sbatch-lines              #SBATCH lines for given resources
clipforge registry init|push|list|show|diff|pull|promote|propose|history|sync|review|verify|protect|gc
                                         model versions as Git LFS branches
clipforge store inspect|verify STORE     a clip store's videos (timing, decodable span, what is odd); its shards
clipforge fl certs DIR | join ...        TLS and client keys for a Flower federation; a site joining one
clipforge models import PATH --from F    a published checkpoint (VideoMAE, VideoMAE V2, Hugging Face, torchvision)
clipforge demo                           the main job on the embedded default
"""

from __future__ import annotations

import argparse
import sys

from clipforge.base.logs import setup_logging
from clipforge.jobs import config
from clipforge.jobs.commands import cluster, demo, fl, jobs, models, registry, store

# In --help's order; each group adds its subcommands and sets func, the function the chosen one runs.
GROUPS = (cluster, jobs, registry, store, fl, models, demo)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    # Only a job's own options (jobs run, jobs sbatch-lines) pass through to it; anything else is a typo.
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    setup_logging()
    return config.guarded(lambda: args.func(args, rest))()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clipforge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(metavar="COMMAND")
    for group in GROUPS:
        group.add_to(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
