"""Aliases (``production``, ``staging``): annotated tags ``<name>/<alias>`` on a version branch's tip, moved with
compare-and-swap, and the record of every move on ``main``.

A promotion changes ``main``'s ``aliases.yaml`` and history in the same atomic push as the tag, or proposes the
change as a branch whose merge moves the alias. Merging sibling version branches into one branch would conflict
on the weights, so an alias is a tag, never a branch.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import git

from . import ledger
from .origin import AUTHOR, Origin, lost_race, run_git
from .refs import VERSION_BRANCHES, Ref, RegistryError, alias_tag, peeled_alias


def versions(origin: Origin, name: str | None = None) -> dict[str, dict[str, int]]:
    """``{name: {alias: version}}`` from the alias tags (peeled to the version branch's commit)."""
    tags = origin.ls_remote("--tags", "refs/tags/*")
    heads = {sha: ref for ref, sha in origin.ls_remote("--heads", VERSION_BRANCHES).items()}
    out: dict[str, dict[str, int]] = {}
    for ref, sha in tags.items():
        named = peeled_alias(ref)
        version = Ref.of_branch(heads.get(sha, ""))
        if named and version and (name is None or named[0] == name):
            out.setdefault(named[0], {})[named[1]] = version.version
    return out


def promote(origin: Origin, ref: Ref, alias: str, expect: int | None | str, why: str, attempts: int) -> Ref:
    """Point ``alias`` at the resolved version ``ref`` unless someone else moves it first (see Registry.promote)."""
    tag = alias_tag(ref.name, alias)
    seen = versions(origin, ref.name).get(ref.name, {}).get(alias)
    if expect != "current" and seen != expect:
        raise RegistryError(
            f"{ref.name}@{alias} points to {f'v{seen}' if seen else 'nothing'}, not "
            f"{f'v{expect}' if expect else 'nothing'} as expected: someone promoted meanwhile; look and retry"
        )
    moved_meanwhile = (
        f"{ref.name}@{alias} was moved by someone else while promoting {ref}; check `clipforge "
        f"registry list {ref.name}` and retry"
    )
    with origin.clone(ref.branch) as repo:
        for _ in range(attempts):
            old = origin.ls_remote("--tags", f"{tag}*").get(tag, "")
            current = versions(origin, ref.name).get(ref.name, {}).get(alias)
            if current != seen:
                raise RegistryError(moved_meanwhile)
            run_git(repo, "fetch", "origin", "+refs/heads/main:refs/remotes/origin/main")
            repo.git.checkout("-B", "main", "origin/main")
            _commit_move(repo, ref, alias, current, why, via="promote")
            _tag(repo, ref, alias)
            try:
                run_git(
                    repo, "push", "--atomic", f"--force-with-lease={tag}:{old}", "origin", f"{tag}:{tag}", "main:main"
                )
                return ref
            except RegistryError as exc:
                if "stale info" in exc.detail:
                    raise RegistryError(moved_meanwhile) from exc
                if not lost_race(exc):
                    raise
    raise RegistryError(f"gave up promoting {ref} after {attempts} attempts: main keeps moving")


def propose(origin: Origin, ref: Ref, alias: str, why: str) -> str:
    """Push branch ``promote/<name>/<alias>/v<N>``, ``main`` with the resolved version ``ref`` named for
    ``alias``; returns the branch."""
    current = versions(origin, ref.name).get(ref.name, {}).get(alias)
    branch = f"promote/{ref.name}/{alias}/v{ref.version}"
    with origin.clone("main") as repo:
        repo.git.checkout("-B", branch, "origin/main")
        _commit_move(repo, ref, alias, current, why, via=f"pull request {branch}")
        run_git(repo, "push", "--force", "origin", f"{branch}:{branch}")
    return branch


def history(origin: Origin, name: str) -> list[dict[str, Any]]:
    """Every alias move of ``name``, oldest first, with the commit on ``main`` that made it and its committer
    (for a merged pull request: who merged it, and when)."""
    path = f"models/{name}/history.jsonl"
    with origin.clone("main") as repo:
        try:
            text = repo.git.show(f"origin/main:{path}")
        except git.GitCommandError:
            return []
        blame = repo.git.blame("--first-parent", "--line-porcelain", "origin/main", "--", path)
    commits = []
    for line in blame.splitlines():
        if re.match(r"^[0-9a-f]{40} \d+ \d+", line):
            commits.append({"commit": line[:40]})
        elif line.startswith("committer ") and commits:
            commits[-1]["merged_by"] = line[len("committer ") :]
        elif line.startswith("committer-time ") and commits:
            commits[-1]["merged_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(line.split()[1])))
    moves = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{**m, **c} for m, c in zip(moves, commits)]


def sync(origin: Origin) -> list[str]:
    """Point every alias tag at what ``main``'s alias files say; compare-and-swap per tag. Returns the moves."""
    moved = []
    with origin.clone("main") as repo:
        wanted = ledger.aliases(Path(repo.working_tree_dir))
        have = versions(origin)
        for (name, alias), version in sorted(wanted.items()):
            if have.get(name, {}).get(alias) == version:
                continue
            ref = Ref(name, version=version)
            tag = alias_tag(name, alias)
            old = origin.ls_remote("--tags", f"{tag}*").get(tag, "")
            run_git(repo, "fetch", "origin", f"+refs/heads/{ref.branch}:refs/remotes/origin/{ref.branch}")
            _tag(repo, ref, alias)
            run_git(repo, "push", f"--force-with-lease={tag}:{old}", "origin", f"{tag}:{tag}")
            moved.append(f"{name}@{alias} -> v{version}")
    return moved


def _commit_move(repo: git.Repo, ref: Ref, alias: str, current: int | None, why: str, via: str) -> None:
    """Commit, on the checked-out branch, ``aliases.yaml`` naming the new version and a line of history."""
    repo.git.add(ledger.record_move(Path(repo.working_tree_dir), ref, alias, current, why, via))
    moved = f"v{current}" if current else "unset"
    repo.git.commit("-m", f"{ref.name}@{alias}: {moved} -> v{ref.version}" + (f"\n\n{why}" if why else ""), env=AUTHOR)


def _tag(repo: git.Repo, ref: Ref, alias: str) -> None:
    """The annotated alias tag, made (or moved) locally on the fetched version branch."""
    repo.git.tag(
        "-f",
        "-a",
        f"{ref.name}/{alias}",
        f"origin/{ref.branch}",
        "-m",
        f"{ref.name} {alias}: v{ref.version}",
        env=AUTHOR,
    )
