"""The registry's own records on ``main``, one folder ``models/<name>/`` per model, read and written in a clone.

``versions.jsonl`` is the ledger: each version's commit and weights' sha256, as pushed. ``aliases.yaml`` names
the version each alias points to (a pull request changing it is a promotion). ``history.jsonl`` holds every
alias move: who, when, from, to, why. The ledger and the history are append-only: the remote's hook refuses a
``main`` that loses a line of either.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .refs import Ref


def folder(worktree: Path, name: str) -> Path:
    return Path(worktree) / "models" / name


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def append_version(worktree: Path, name: str, entry: dict[str, Any]) -> str:
    """Add a version's line to ``name``'s ledger; returns the file's path inside the repository."""
    _append_jsonl(folder(worktree, name) / "versions.jsonl", entry)
    return f"models/{name}/versions.jsonl"


def versions(worktree: Path) -> dict[str, dict[str, Any]]:
    """Every ledger line of every model, by the version's full branch name (``name`` added to each)."""
    ledger = {}
    for model in _models(worktree):
        path = model / "versions.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            entry = json.loads(line)
            ledger[f"refs/heads/{Ref(model.name, version=entry['version']).branch}"] = {**entry, "name": model.name}
    return ledger


def aliases(worktree: Path) -> dict[tuple[str, str], int]:
    """``{(name, alias): version}`` as every model's ``aliases.yaml`` says."""
    return {
        (model.name, alias): version
        for model in _models(worktree)
        for alias, version in read_aliases(model / "aliases.yaml").items()
    }


def record_move(worktree: Path, ref: Ref, alias: str, current: int | None, why: str, via: str) -> str:
    """Write ``aliases.yaml`` naming ``ref`` for ``alias`` and a line of history; returns the folder to add."""
    model = folder(worktree, ref.name)
    model.mkdir(parents=True, exist_ok=True)
    named = read_aliases(model / "aliases.yaml")
    named[alias] = ref.version
    (model / "aliases.yaml").write_text("".join(f"{a}: {v}\n" for a, v in sorted(named.items())))
    move = {"alias": alias, "from": current, "to": ref.version, "by": who(), "at": now(), "why": why, "via": via}
    _append_jsonl(model / "history.jsonl", move)
    return f"models/{ref.name}"


def read_aliases(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        alias, _, version = line.partition(":")
        if version.strip().isdigit():
            found[alias.strip()] = int(version)
    return found


def _models(worktree: Path) -> list[Path]:
    root = Path(worktree) / "models"
    return sorted(root.iterdir()) if root.is_dir() else []


def _append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
