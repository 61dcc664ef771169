"""A version's life: its number, taken from the remote's branches; the push that makes it from a finished run
(weights, record, card and ledger line in one atomic push); the pull that brings its weights back, verified.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import git
import yaml

from clipforge.rundir import RunDir, RunRecord

from . import ledger, lfs, protect
from .card import model_card
from .origin import AUTHOR, Origin, last_line, lost_race, run_git
from .refs import VERSION_BRANCHES, Ref, RegistryError

OnStep = Callable[[str, float], None]
"""Told each step of a push and the seconds it took (the benchmark prints where a push's time goes)."""


def numbers(origin: Origin, name: str | None = None) -> dict[str, list[int]]:
    """Versions of every model (or of ``name``), from one ``git ls-remote``: no clone, no download."""
    found: dict[str, list[int]] = {}
    for branch in origin.ls_remote("--heads", VERSION_BRANCHES):
        ref = Ref.of_branch(branch)
        if ref and (name is None or ref.name == name):
            found.setdefault(ref.name, []).append(ref.version)
    return {k: sorted(v) for k, v in sorted(found.items())}


def show(origin: Origin, ref: Ref, file: str) -> str:
    """The text of one of a version's files (``model.yaml``, ``MODEL.md``)."""
    with origin.clone(ref.branch) as repo:
        return repo.git.show(f"origin/{ref.branch}:{ref.name}/{file}")


def record(run: RunRecord, config: dict[str, Any], name: str, version: int, parent: int | None) -> dict[str, Any]:
    """A version's ``model.yaml``, less its files: what the run was, how it was trained, how well it did."""
    out = {
        "name": name,
        "version": version,
        "parent": f"{name}@v{parent}" if parent is not None else None,
        "created": ledger.now(),
        "architecture": {
            "model": run.model,
            **run.architecture,
            "input": dataclasses.asdict(run.input),
            "crop": run.crop,
        },
        "classes": run.classes,
        "metrics": run.metrics,
        "metrics_split": run.metrics_split,
        "per_class_accuracy": run.per_class_accuracy,
        "data_fingerprint": run.data_fingerprint,
        "training_config": config,
        "code_commit": run.code_commit,
        "slurm_job_id": run.slurm_job_id,
    }
    # How it came to be, when not by the plain trainer.
    for how in ("parameter_server", "federated", "imported", "pretraining"):
        if getattr(run, how) is not None:
            out[how] = getattr(run, how)
    return out


def push(origin: Origin, run_dir: Path, name: str, attempts: int, on_step: OnStep | None = None) -> Ref:
    """A new version of ``name`` from a finished run; the next free number, retried if another push takes it."""
    Ref.parse(name)
    run_dir = RunDir(run_dir)
    if not run_dir.is_finished():
        raise RegistryError(
            f"{run_dir} is not a finished run: it has no final weights and run record; train it to the end first"
        )
    run, config, weights = run_dir.record(), run_dir.config(), run_dir.weights
    started = time.perf_counter()
    with origin.clone("main", share_store=True) as repo:
        _took(on_step, "clone of main (no checkout of weights)", started)
        stored: tuple[str, int] | None = None
        for _ in range(attempts):
            started = time.perf_counter()
            run_git(repo, "fetch", "origin", "+refs/heads/main:refs/remotes/origin/main")
            taken = numbers(origin, name).get(name, [])
            _took(on_step, "fetch of main, ls-remote of versions", started)
            ref = Ref(name, version=(taken[-1] if taken else 0) + 1)
            model_yaml = record(run, config, name, ref.version, taken[-1] if taken else None)
            repo.git.checkout("-B", ref.branch, "origin/main")
            folder = Path(repo.working_tree_dir) / name
            folder.mkdir(exist_ok=True)
            if stored is None:
                started = time.perf_counter()
                stored = lfs.store(lfs.storage(repo), weights)
                _took(on_step, "sha256 and copy into the LFS store", started)
            started = time.perf_counter()
            digest, size = stored
            lfs.stage_pointer(repo, f"{name}/model.safetensors", lfs.pointer(digest, size))
            model_yaml["files"] = {"model.safetensors": {"sha256": digest, "size": size}}
            (folder / "model.yaml").write_text(yaml.safe_dump(model_yaml, sort_keys=False))
            (folder / "MODEL.md").write_text(model_card(model_yaml))
            repo.git.add(f"{name}/model.yaml", f"{name}/MODEL.md")
            # The trailer is what the remote's hook checks a new version branch for.
            repo.git.commit("-m", f"{name} v{ref.version}\n\n{protect.TRAILER}: {ref}", env=AUTHOR)
            entry = {
                "version": ref.version,
                "commit": repo.head.commit.hexsha,
                "sha256": digest,
                "size": size,
                "by": ledger.who(),
                "at": model_yaml["created"],
            }
            repo.git.checkout("-B", "main", "origin/main")
            repo.git.add(ledger.append_version(Path(repo.working_tree_dir), name, entry))
            repo.git.commit("-m", f"ledger: {ref} at {entry['commit'][:12]}", env=AUTHOR)
            _took(on_step, "record, card and ledger: git add and two commits", started)
            started = time.perf_counter()
            try:
                run_git(repo, "push", "--atomic", "origin", f"{ref.branch}:{ref.branch}", "main:main")
                _took(on_step, "git push --atomic (git-lfs pre-push, the remote's hooks)", started)
                return ref
            except RegistryError as exc:
                if not lost_race(exc):
                    raise
                # Another push took this number or moved main; its loser's LFS upload is an orphan for `gc`.
        raise RegistryError(f"gave up pushing {name} after {attempts} attempts: too many concurrent pushes")


def pull(origin: Origin, ref: Ref, to: Path) -> list[str]:
    """Fetch one version's files (only its LFS objects), verify the weights' sha256, copy them to ``to``.

    Returns the LFS object ids that were downloaded.
    """
    if origin.local_bare() is not None:
        return _pull_local(origin, ref, Path(to))
    with origin.clone(ref.branch) as repo:
        model_yaml = yaml.safe_load(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.yaml"))
        # `git lfs fetch origin models/x/v1` answers "Invalid ref argument": name the remote-tracking ref.
        try:
            run_git(
                repo, "lfs", "fetch", "origin", f"origin/{ref.branch}", "--include", f"{ref.name}/model.safetensors"
            )
        except RegistryError as exc:
            # git-lfs checks every object it downloads against its sha256 and refuses a changed one.
            if "invalid hash" in exc.detail or "expected OID" in exc.detail:
                raise RegistryError(
                    f"{ref}: the stored weights do not match their sha256 (changed in the remote's LFS store); "
                    "refusing them",
                    detail=exc.detail,
                ) from None
            raise
        oid = _recorded_oid(ref, repo.git.show(f"origin/{ref.branch}:{ref.name}/model.safetensors"), model_yaml)
        storage = lfs.storage(repo)
        fetched = sorted(p.name for p in (storage / "objects").glob("*/*/*"))
        to = Path(to)
        to.mkdir(parents=True, exist_ok=True)
        # The verified object itself becomes the file: one move, no checkout copy.
        shutil.move(lfs.object_path(storage, oid), to / "model.safetensors")
        for file in ("model.yaml", "MODEL.md"):
            (to / file).write_text(repo.git.show(f"origin/{ref.branch}:{ref.name}/{file}") + "\n")
    return fetched


def _pull_local(origin: Origin, ref: Ref, to: Path) -> list[str]:
    """Pull from a bare repository on a reachable filesystem: one hash and one copy of the object.

    git-lfs would copy the object into a clone (hashing it), then check it out (a second copy); the
    object is a plain file in the remote's store, so hashing it and copying it out is the floor. A changed
    object is refused as git-lfs refuses it. The version's files are read from the bare repository itself
    (read-only): no clone.
    """
    bare = origin.local_bare()

    def show(path: str) -> str:
        try:
            return git.Git().execute(["git", "--git-dir", str(bare), "show", f"refs/heads/{ref.branch}:{path}"])
        except git.GitCommandError as exc:
            raise RegistryError(f"{ref}: cannot read {path} from {origin.url}: {last_line(exc)}") from None

    model_yaml = yaml.safe_load(show(f"{ref.name}/model.yaml"))
    oid = _recorded_oid(ref, show(f"{ref.name}/model.safetensors"), model_yaml)
    source = lfs.object_path(bare / "lfs", oid)
    if not source.exists():
        raise RegistryError(f"{ref}: the registry has no LFS object {oid[:12]}... for its weights; push it again")
    to.mkdir(parents=True, exist_ok=True)
    if not lfs.copy_verified(source, to / "model.safetensors", oid):
        raise RegistryError(
            f"{ref}: the stored weights do not match their sha256 (changed in the remote's LFS store); refusing them"
        )
    for file in ("model.yaml", "MODEL.md"):
        (to / file).write_text(show(f"{ref.name}/{file}") + "\n")
    return [oid]


def _recorded_oid(ref: Ref, pointer: str, model_yaml: dict[str, Any]) -> str:
    """The weights' oid from their pointer, refused unless it is the sha256 the version's record names."""
    oid = lfs.pointer_oid(pointer)
    expected = model_yaml["files"]["model.safetensors"]["sha256"]
    if oid != expected:
        raise RegistryError(
            f"{ref}: the weights' sha256 {oid[:12]}... is not the one its record names ({expected[:12]}...); "
            "refusing them"
        )
    return oid


def _took(on_step: OnStep | None, what: str, started: float) -> None:
    if on_step is not None:
        on_step(what, time.perf_counter() - started)
