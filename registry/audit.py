"""Auditing a registry after the fact: ``verify`` checks every version and alias against ``main``'s records and
every version's weights against their sha256 (any remote); ``gc`` deletes the LFS objects no ref names (a bare
path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import git
import yaml

from clipforge.base.files import sha256

from . import ledger, lfs
from .origin import Origin, run_git
from .refs import VERSION_BRANCHES, Ref, RegistryError, peeled_alias


def verify(origin: Origin) -> tuple[list[str], dict[str, int]]:
    """Problems (each naming its version or alias) and counts; see Registry.verify."""
    problems: list[str] = []
    heads = origin.ls_remote("--heads", VERSION_BRANCHES)
    tags = origin.ls_remote("--tags", "refs/tags/*")
    with origin.clone("main") as repo:
        worktree = Path(repo.working_tree_dir)
        versions, wanted = ledger.versions(worktree), ledger.aliases(worktree)
        for branch, entry in sorted(versions.items()):
            ref, now = Ref(entry["name"], version=entry["version"]), heads.get(branch)
            if now is None:
                problems.append(f"{ref}: its branch was deleted (pushed as {entry['commit'][:12]})")
            elif now != entry["commit"]:
                problems.append(
                    f"{ref}: rewritten after its push: the branch is at {now[:12]}, pushed as {entry['commit'][:12]}"
                )
        for branch in sorted(set(heads) - set(versions)):
            problems.append(f"{Ref.of_branch(branch) or branch}: not in the ledger (pushed behind the registry's back)")
        for branch, entry in sorted(versions.items()):
            if heads.get(branch) is not None:
                problems += _verify_weights(repo, Ref(entry["name"], version=entry["version"]), entry)
        released = {heads[b]: b for b in heads}
        for ref, sha in sorted(tags.items()):
            named = peeled_alias(ref)
            if named is None:
                continue
            name, alias = named
            version = Ref.of_branch(released.get(sha, ""))
            if version is None or version.name != name:
                problems.append(f"{name}@{alias}: the tag points at {sha[:12]}, which is no released version of {name}")
            elif wanted.get((name, alias), version.version) != version.version:
                problems.append(
                    f"{name}@{alias}: main's aliases.yaml names v{wanted[(name, alias)]} but the tag points at "
                    f"v{version.version}; run clipforge registry sync"
                )
    return problems, {"versions": len(heads), "aliases": sum(1 for r in tags if r.endswith("^{}"))}


def _verify_weights(repo: git.Repo, ref: Ref, entry: dict[str, Any]) -> list[str]:
    """Fetch one version's weights and hash them: against the pointer, the record and the ledger."""
    run_git(repo, "fetch", "origin", f"+refs/heads/{ref.branch}:refs/remotes/origin/{ref.branch}")
    path = f"{ref.name}/model.safetensors"
    oid = lfs.pointer_oid(repo.git.show(f"origin/{ref.branch}:{path}"))
    record = yaml.safe_load(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.yaml"))
    recorded = record["files"]["model.safetensors"]["sha256"]
    if not oid == recorded == entry["sha256"]:
        return [
            f"{ref}: the weights' pointer says {oid[:12]}, model.yaml {recorded[:12]}, "
            f"the ledger {entry['sha256'][:12]}"
        ]
    try:
        run_git(repo, "lfs", "fetch", "origin", f"origin/{ref.branch}", "--include", path)
    except RegistryError as exc:
        return [f"{ref}: its weights could not be fetched or do not match their sha256 {oid[:12]}: {exc}"]
    stored = lfs.object_path(lfs.storage(repo), oid)
    if not stored.exists():
        return [f"{ref}: the remote has no LFS object {oid[:12]} for its weights"]
    digest = sha256(stored)
    if digest != oid:
        return [f"{ref}: its weights hash to {digest[:12]}, not their recorded sha256 {oid[:12]}"]
    stored.unlink()  # one version's weights on disk at a time
    return []


def gc(origin: Origin) -> list[str]:
    """Delete LFS objects no branch or tag refers to (left by lost push races); bare path remotes only."""
    store = origin.bare_path() / "lfs" / "objects"
    if not store.is_dir():
        return []
    with origin.clone("main", all_refs=True) as repo:
        listing = run_git(repo, "lfs", "ls-files", "--all", "--long")
    referenced = {line.split()[0] for line in listing.splitlines() if line.strip()}
    removed = []
    for path in store.glob("*/*/*"):
        if path.is_file() and path.name not in referenced:
            path.unlink()
            removed.append(path.name)
    return removed
