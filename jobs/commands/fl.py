"""``clipforge fl certs FOLDER``: a federation's keys; ``clipforge fl join``: a site joins a federation."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_to(commands: argparse._SubParsersAction) -> None:
    fl = commands.add_parser("fl", help="federated training on Flower: the federation's keys; join from another site")
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
    join = verbs.add_parser(
        "join",
        help="run this site's client (a SuperNode) in a federation served elsewhere, until the federation ends",
    )
    join.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the federation's gate, as its job logs")
    join.add_argument("--ca", required=True, type=Path, help="the federation's ca.crt, from the job's owner")
    join.add_argument("--key", required=True, type=Path, help="this site's client-N.key, from the job's owner")
    join.add_argument("--cert", required=True, type=Path, help="this site's client-N.crt, from the job's owner")
    join.add_argument("--data.store", dest="store", required=True, type=Path, help="this site's clip store")
    join.add_argument("--data.train-split", dest="split", default="train", help="the split it trains on")
    join.add_argument(
        "--partition",
        default=None,
        metavar="I/N",
        help="train on share I of N of the split (as the job's own clients do: iid); default: all of it",
    )
    join.add_argument("--seed", type=int, default=0, help="the seed of the shares (the job's --seed)")
    join.add_argument(
        "--work", type=Path, default=Path("fl-join"), help="where this site's SuperNode and gate keep logs and state"
    )
    join.set_defaults(func=_join)


def _certs(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.ps import certs

    made = certs.make_certs(Path(args.folder), args.clients, tuple(args.host) if args.host else None)
    hosts = sorted(certs.server_hosts(Path(args.folder)))
    print(f"{len(made)} files made in {args.folder} (server certificate for {', '.join(hosts)})")
    print("\n".join(certs.handout(Path(args.folder), args.clients)))
    return 0


def _join(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.preprocess.store import ClipStore
    from clipforge.ps import certs
    from clipforge.ps.flower import FlowerError, SuperNode

    for flag, path in (("--ca", args.ca), ("--key", args.key), ("--cert", args.cert)):
        if not path.is_file():
            raise certs.CertError(f"{flag} {path}: no such file; the job's owner hands it out (clipforge fl certs)")
    certs.tls_key_pem(args.key)  # one line if it is not a client key
    host, _, port = args.superlink.rpartition(":")
    if not host or not port.isdigit():
        raise FlowerError(f"--superlink {args.superlink}: give HOST:PORT, as the federation's job logs it")
    ClipDataset(ClipStore.open(args.store), args.split)  # one line if the store or split is not there
    index, parts = 0, 1
    if args.partition is not None:
        first, _, second = args.partition.partition("/")
        if not (first.isdigit() and second.isdigit() and int(first) < int(second)):
            raise FlowerError(f"--partition {args.partition}: give I/N with I below N, e.g. 2/4")
        index, parts = int(first), int(second)
    config = {"store": str(args.store.resolve()), "split": args.split, "partition-id": index}
    config.update({"num-partitions": parts, "partition": "iid", "seed": args.seed})
    node = SuperNode(
        0, args.key.resolve(), args.cert.resolve(), args.ca.resolve(), args.superlink, config, None, args.work.resolve()
    )
    try:
        try:
            node.wait_ready()
        except FlowerError:
            raise FlowerError(f"the federation at {args.superlink} refused this site: {node.refusal()}") from None
        print(f"joined the federation at {args.superlink}; training when it samples this site (log: {node.log})")
        while node.process.poll() is None and not node.gave_up():
            time.sleep(2.0)
    finally:
        node.stop()
    print(f"the federation at {args.superlink} is gone (it finished, or its server stopped); this site stopped too")
    return 0
