"""``clipforge store inspect|verify STORE``: look into a packed clip store."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_to(commands: argparse._SubParsersAction) -> None:
    store = commands.add_parser("store", help="look into a packed clip store")
    verbs = store.add_subparsers(metavar="VERB")
    inspect = verbs.add_parser(
        "inspect",
        help="per store and per video: timing, decodable span, clips, repeated frames, the videos worth a look",
    )
    inspect.add_argument("store", help="the store's directory")
    inspect.add_argument("--json", action="store_true", help="everything, every video included, as JSON")
    inspect.add_argument("--all", action="store_true", help="list every video, not only those worth a look")
    inspect.set_defaults(func=_inspect)
    verify = verbs.add_parser("verify", help="check that every shard is there with the size the index recorded")
    verify.add_argument("store", help="the store's directory")
    verify.set_defaults(func=_verify)


def _inspect(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.preprocess.quality import inspect_store

    report = inspect_store(Path(args.store))
    print(json.dumps(report.to_json(), indent=1) if args.json else "\n".join(report.lines(every_video=args.all)))
    return 0


def _verify(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.preprocess.store import ClipStore

    store = ClipStore.open(Path(args.store))
    store.verify()
    print(f"{args.store}: {len(store.shard_names)} shards, every one present with its recorded size")
    return 0
