"""``clipforge registry VERB``: model versions as Git LFS branches, aliases as tags, in a remote registry.

The registry room is imported when a verb runs, not when the command line is built: it loads git.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipforge.jobs import config

if TYPE_CHECKING:
    from clipforge.registry.repo import Ref, Registry

REF_HELP = "a version: NAME@vN, or NAME@ALIAS (an alias tag such as production)"


def add_to(commands: argparse._SubParsersAction) -> None:
    registry = commands.add_parser(
        "registry", help="model versions in a Git LFS registry (--remote or $CLIPFORGE_REGISTRY)"
    )
    registry.add_argument(
        "--remote",
        default=os.environ.get("CLIPFORGE_REGISTRY"),
        help="registry remote: a bare repository path or a URL",
    )
    registry.add_argument(
        "--lfs-url",
        default=os.environ.get("CLIPFORGE_REGISTRY_LFS_URL"),
        help="LFS server URL when it is not the git remote's",
    )
    verbs = registry.add_subparsers(metavar="VERB")
    for verb, (run, text, arguments) in VERBS.items():
        p = verbs.add_parser(verb, help=text, description=text)
        for flag, options in arguments:
            p.add_argument(flag, **options)
        p.set_defaults(func=_run, verb=run)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    if not args.remote:
        raise config.ConfigError("no registry: pass --remote PATH_OR_URL or set CLIPFORGE_REGISTRY")
    return args.verb(args)


def _open(args: argparse.Namespace) -> Registry:
    from clipforge.registry.repo import Registry

    return Registry(args.remote, args.lfs_url)


def _ref(text: str) -> Ref:
    from clipforge.registry.repo import Ref

    return Ref.parse(text)


def _init(args: argparse.Namespace) -> int:
    from clipforge.registry.repo import Registry

    bare = "://" not in args.remote
    Registry.init(args.remote, args.lfs_url, bare=bare, group=args.group)
    print(
        f"registry created at {args.remote}"
        + (
            ": versions and aliases cannot be rewritten or deleted there"
            if bare
            else f"; protect it on the host: clipforge registry --remote {args.remote} protect"
        )
    )
    return 0


def _push(args: argparse.Namespace) -> int:
    ref = _open(args).push(Path(args.run_dir), args.name)
    print(f"pushed {ref} (branch {ref.branch}); review it with: clipforge registry review {ref}")
    return 0


def _list(args: argparse.Namespace) -> int:
    registry = _open(args)
    aliases = registry.aliases(args.name)
    for name, versions in registry.versions(args.name).items():
        tags = {v: a for a, v in aliases.get(name, {}).items()}
        print(f"{name}: " + " ".join(f"v{v}" + (f" ({tags[v]})" if v in tags else "") for v in versions))
    return 0


def _show(args: argparse.Namespace) -> int:
    registry = _open(args)
    print(registry.card(_ref(args.ref)))
    return 0


def _diff(args: argparse.Namespace) -> int:
    registry = _open(args)
    print(json.dumps(registry.diff(_ref(args.a), _ref(args.b)), indent=1, default=str))
    return 0


def _pull(args: argparse.Namespace) -> int:
    registry = _open(args)
    fetched = registry.pull(_ref(args.ref), Path(args.to))
    print(f"pulled {args.ref} into {args.to} ({len(fetched)} LFS object(s) downloaded, sha256 verified)")
    return 0


def _promote(args: argparse.Namespace) -> int:
    registry = _open(args)
    expect = "current" if args.expect is None else (None if args.expect == "none" else int(args.expect.lstrip("v")))
    ref = registry.promote(_ref(args.ref), args.alias, expect=expect, why=args.why)
    print(f"{ref.name}@{args.alias} -> v{ref.version}")
    return 0


def _propose(args: argparse.Namespace) -> int:
    registry = _open(args)
    branch, text = registry.propose(_ref(args.ref), args.alias, why=args.why)
    print(text)
    print(f"\nproposed on branch {branch}: merging it into main moves {args.ref.split('@')[0]}@{args.alias}")
    return _open_pull_request(f"Promote {args.ref} to {args.alias}", text, branch) if args.open else 0


def _history(args: argparse.Namespace) -> int:
    moves = _open(args).history(args.name)
    if not moves:
        print(f"{args.name}: no alias has moved yet")
    for m in moves:
        before = f"v{m['from']}" if m["from"] else "unset"
        merged = f", merged by {m['merged_by'].rsplit(' ', 2)[0]}" if m["via"].startswith("pull request") else ""
        print(
            f"{m['at']}  {args.name}@{m['alias']}: {before} -> v{m['to']}  by {m['by']} via {m['via']}{merged}"
            + (f": {m['why']}" if m["why"] else "")
        )
    return 0


def _sync(args: argparse.Namespace) -> int:
    moved = _open(args).sync()
    print("\n".join(moved) if moved else "every alias tag already matches main")
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems, counts = _open(args).verify()
    for problem in problems:
        print(f"TAMPERED  {problem}")
    print(
        f"{counts['versions']} versions and {counts['aliases']} aliases checked: "
        + (f"{len(problems)} problem(s)" if problems else "every version matches its ledger and sha256")
    )
    return 1 if problems else 0


def _protect(args: argparse.Namespace) -> int:
    from clipforge.registry.protect import apply_rules, hosted_rules

    host, commands, what = hosted_rules(args.remote)
    print(f"# {host}: {what}")
    for command in commands:
        argv, stdin = (command[:-1], command[-1]) if "--input" in command else (command, None)
        line = shlex.join(argv)
        print(f"echo {shlex.quote(stdin)} | {line}" if stdin else line)
    if args.apply:
        for done in apply_rules(commands):
            print(f"applied: {done}")
    else:
        print("# run these (or pass --apply with the host's CLI installed); `registry verify` checks afterwards")
    return 0


def _review(args: argparse.Namespace) -> int:
    registry = _open(args)
    text = registry.review(_ref(args.ref), args.against, weights_too=not args.no_weights)
    print(text)
    return _open_pull_request(str(_ref(args.ref)), text) if args.open else 0


def _gc(args: argparse.Namespace) -> int:
    removed = _open(args).gc()
    print(f"removed {len(removed)} orphaned LFS object(s)")
    return 0


def _open_pull_request(title: str, body: str, head: str | None = None) -> int:
    tools = (
        ("gh", ["gh", "pr", "create", "--title", title, "--body", body, *(["--head", head] if head else [])]),
        (
            "glab",
            [
                "glab",
                "mr",
                "create",
                "--title",
                title,
                "--description",
                body,
                *(["--source-branch", head] if head else []),
            ],
        ),
    )
    for tool, argv in tools:
        if shutil.which(tool):
            return subprocess.run(argv, check=False).returncode
    print("neither gh nor glab is installed: paste the text above into a new pull request", file=sys.stderr)
    return 0


# Each verb: the function it runs, its help, and its arguments (flag, add_argument's options), in --help's order.
VERBS: dict[str, tuple[Callable[[argparse.Namespace], int], str, list[tuple[str, dict[str, Any]]]]] = {
    "init": (
        _init,
        "create a registry: a protected bare repository at --remote, and its main branch",
        [("--group", {"help": "Unix group that shares the repository: its members push, nobody else writes"})],
    ),
    "push": (
        _push,
        "push a finished run as the next version of NAME",
        [
            ("run_dir", {"help": "a finished run directory (it has final weights and a run record)"}),
            ("--name", {"required": True, "help": "model name; versions of it are numbered v1, v2, ..."}),
        ],
    ),
    "list": (_list, "models, versions and aliases", [("name", {"nargs": "?", "help": "only this model"})]),
    "show": (_show, "a version's card (NAME@vN or NAME@ALIAS)", [("ref", {"help": REF_HELP})]),
    "diff": (
        _diff,
        "metric, config and size differences of two versions",
        [
            ("a", {"help": "the base version (NAME@vN or NAME@ALIAS)"}),
            ("b", {"help": "the version compared with it"}),
        ],
    ),
    "pull": (
        _pull,
        "fetch one version's files, verified, into --to",
        [
            ("ref", {"help": REF_HELP}),
            ("--to", {"required": True, "help": "directory to put model.safetensors, model.yaml and MODEL.md in"}),
        ],
    ),
    "promote": (
        _promote,
        "point an alias tag at a version (compare-and-swap)",
        [
            ("ref", {"help": "the version to promote (NAME@vN)"}),
            ("--alias", {"required": True, "help": "alias to point at it, e.g. production or staging"}),
            (
                "--expect",
                {
                    "help": "the version the alias must point at now (vN, or none for a new alias); "
                    "default: whatever it points at when read, so a concurrent promote is refused"
                },
            ),
            ("--why", {"default": "", "help": "why, for the alias's history"}),
        ],
    ),
    "propose": (
        _propose,
        "propose a promotion as a pull request: a branch whose merge into main moves the alias",
        [
            ("ref", {"help": "the version to promote (NAME@vN)"}),
            ("--alias", {"required": True, "help": "alias to point at it, e.g. production"}),
            ("--why", {"default": "", "help": "why, for the alias's history and the pull request"}),
            ("--open", {"action": "store_true", "help": "open the pull request with gh or glab"}),
        ],
    ),
    "history": (_history, "every alias move of a model: who, when, from, to, why", [("name", {"help": "model name"})]),
    "sync": (_sync, "point alias tags at what main's alias files say (after a merge on a host without hooks)", []),
    "verify": (
        _verify,
        "check versions against the ledger, weights against their sha256, aliases against versions",
        [],
    ),
    "protect": (
        _protect,
        "print (or apply, with gh or glab) the rules that protect a GitHub or GitLab registry",
        [("--apply", {"action": "store_true", "help": "apply them with the host's CLI"})],
    ),
    "review": (
        _review,
        "the pull-request body for a version",
        [
            ("ref", {"help": REF_HELP}),
            (
                "--against",
                {"default": "production", "help": "the version or alias to compare with (default: production)"},
            ),
            ("--open", {"action": "store_true", "help": "open the pull request with gh or glab"}),
            ("--no-weights", {"action": "store_true", "help": "skip the weight diff (it pulls both versions)"}),
        ],
    ),
    "gc": (_gc, "delete LFS objects no version refers to (bare remotes)", []),
}
