"""``clipforge fl certs FOLDER``: the keys of a federation trained on Flower."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_to(commands: argparse._SubParsersAction) -> None:
    fl = commands.add_parser("fl", help="federated training on Flower: the federation's keys")
    verbs = fl.add_subparsers(metavar="VERB")
    certs = verbs.add_parser(
        "certs",
        help="a CA, the server's TLS certificate and one key pair per client, and what to hand to whom",
    )
    certs.add_argument("folder", help="where the keys go (existing ones are kept)")
    certs.add_argument("--clients", type=int, default=2, help="client key pairs to make (client-0 ... client-N-1)")
    certs.add_argument(
        "--host",
        action="append",
        default=None,
        help="a name or address the server is reached at (repeat; default: the certificate there, or localhost "
        "and 127.0.0.1); a new one re-issues the server's certificate from the same CA",
    )
    certs.set_defaults(func=_certs)


def _certs(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.ps import certs

    made = certs.make_certs(Path(args.folder), args.clients, tuple(args.host) if args.host else None)
    hosts = sorted(certs.server_hosts(Path(args.folder)))
    print(f"{len(made)} files made in {args.folder} (server certificate for {', '.join(hosts)})")
    print("\n".join(certs.handout(Path(args.folder), args.clients)))
    return 0
