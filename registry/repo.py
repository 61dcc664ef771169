"""A model registry: a Git repository whose weights live in Git LFS, one branch per version.

``main`` holds a README and ``.gitattributes``; version N of model ``name`` is
branch ``models/<name>/v<N>`` with ``<name>/model.safetensors`` (LFS),
``<name>/model.yaml`` (the machine record) and ``<name>/MODEL.md`` (the card
a reviewer reads). Aliases (``production``, ``staging``) are annotated tags
``<name>/<alias>``, moved with compare-and-swap: merging sibling version
branches into one branch would conflict on the weights.

``main`` also keeps the registry's own records, one folder per model:
``models/<name>/versions.jsonl`` (the ledger: each version's commit and weights'
sha256, as pushed), ``models/<name>/aliases.yaml`` (which version each alias
names) and ``models/<name>/history.jsonl`` (every alias move: who, when, from,
to, why). A promotion changes ``aliases.yaml`` on ``main``, directly or through
a reviewed pull request, and the alias tag follows it. :mod:`.protect` makes a
bare remote refuse any rewrite of all this.

Every operation works in its own clone made with LFS smudging off (instant),
and fetches only the LFS objects it needs. clipforge never writes the user's
global or system git config: the LFS filter is passed on the command line and
installed ``--local`` in each clone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import git
import yaml

from clipforge.base.errors import UserError
from clipforge.rundir import RunDir

from . import protect
from .card import config_changes, model_card, review_text, weight_diff

WEIGHT_PATTERNS = ["*.safetensors", "*.pt", "*.bin", "*.onnx"]
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
LFS_CONFIG = {
    "filter.lfs.process": "git-lfs filter-process",
    "filter.lfs.required": "true",
    "filter.lfs.clean": "git-lfs clean -- %f",
    "filter.lfs.smudge": "git-lfs smudge -- %f",
}
LFS_FILTER = [arg for key, value in LFS_CONFIG.items() for arg in ("-c", f"{key}={value}")]
AUTHOR = {
    "GIT_AUTHOR_NAME": "clipforge",
    "GIT_AUTHOR_EMAIL": "clipforge@localhost",
    "GIT_COMMITTER_NAME": "clipforge",
    "GIT_COMMITTER_EMAIL": "clipforge@localhost",
}


class RegistryError(UserError):
    """Something the user can fix: an unknown model or version, an unreachable remote, a missing tool."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail
        """Everything git said, for deciding what happened (the message keeps one line)."""


@dataclasses.dataclass(frozen=True)
class Ref:
    name: str
    version: int | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        """``name@v3``, ``name@production`` or ``name``."""
        name, _, rest = text.partition("@")
        if not NAME.match(name):
            raise RegistryError(f"{name!r} is not a model name: use lowercase letters, digits, '.', '_' and '-'")
        if not rest:
            return cls(name)
        if re.fullmatch(r"v\d+", rest):
            return cls(name, version=int(rest[1:]))
        if NAME.match(rest):
            return cls(name, alias=rest)
        raise RegistryError(f"{text!r}: after '@' give a version (v3) or an alias (production)")

    @property
    def branch(self) -> str:
        return f"models/{self.name}/v{self.version}"

    def __str__(self) -> str:
        return (
            f"{self.name}@v{self.version}"
            if self.version is not None
            else f"{self.name}@{self.alias}"
            if self.alias
            else self.name
        )


class Registry:
    """A registry reached through its remote URL (a bare repository path, ``file://``, ``git://`` or HTTP)."""

    def __init__(self, remote: str, lfs_url: str | None = None) -> None:
        if shutil.which("git-lfs") is None:
            raise RegistryError("git-lfs is not installed: install it (Debian: apt-get install git-lfs) and retry")
        self.remote = str(remote)
        self.lfs_url = lfs_url
        self.steps: dict[str, float] = {}
        """Seconds each step of the last push took (the benchmark prints where a push's time goes)."""

    # -- creating -----------------------------------------------------------------
    @classmethod
    def init(cls, remote: str, lfs_url: str | None = None, bare: bool = True, group: str | None = None) -> Registry:
        """Create a registry: a protected bare repository at ``remote`` (a path) when asked, and its ``main``.

        ``group``: the Unix group that shares the repository (``core.sharedRepository``): its members
        push, nobody else writes.
        """
        if bare and "://" not in remote:
            Path(remote).mkdir(parents=True, exist_ok=True)
            git.Repo.init(remote, bare=True, initial_branch="main")
            protect.install(Path(remote), group)
        elif group is not None:
            raise RegistryError(f"--group sets a bare repository's permissions; {remote} is not a path")
        registry = cls(remote, lfs_url)
        with tempfile.TemporaryDirectory(prefix="clipforge-registry-") as tmp:
            repo = git.Repo.init(tmp, initial_branch="main")
            registry._configure(repo)
            (Path(tmp) / ".gitattributes").write_text(
                "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in WEIGHT_PATTERNS)
            )
            (Path(tmp) / "README.md").write_text(
                "# Model registry\n\nEach model version is a branch `models/<name>/v<N>`; aliases are tags "
                "`<name>/<alias>` (`git checkout <name>/production`).\n"
                "`models/<name>/` on this branch holds the ledger of versions (`versions.jsonl`), which version "
                "each alias names (`aliases.yaml`; a pull request changing it is a promotion) and every alias "
                "move (`history.jsonl`).\n"
                "Weights are stored with Git LFS. Managed with `clipforge registry`.\n"
            )
            repo.git.add(".gitattributes", "README.md")
            repo.git.commit("-m", "Start the model registry", env=AUTHOR)
            repo.create_remote("origin", registry.remote)
            registry._git(repo, "push", "origin", "main")
        return registry

    # -- reading -------------------------------------------------------------------
    def versions(self, name: str | None = None) -> dict[str, list[int]]:
        """Versions of every model (or of ``name``), from one ``git ls-remote``: no clone, no download."""
        heads = self._ls_remote("--heads", "refs/heads/models/*")
        found: dict[str, list[int]] = {}
        for ref in heads:
            match = re.fullmatch(r"refs/heads/models/([^/]+)/v(\d+)", ref)
            if match and (name is None or match.group(1) == name):
                found.setdefault(match.group(1), []).append(int(match.group(2)))
        return {k: sorted(v) for k, v in sorted(found.items())}

    def aliases(self, name: str | None = None) -> dict[str, dict[str, int]]:
        """``{name: {alias: version}}`` from the alias tags (peeled to the version branch's commit)."""
        tags = self._ls_remote("--tags", "refs/tags/*")
        heads = {sha: ref for ref, sha in self._ls_remote("--heads", "refs/heads/models/*").items()}
        out: dict[str, dict[str, int]] = {}
        for ref, sha in tags.items():
            if not ref.endswith("^{}"):
                continue
            model, _, alias = ref[len("refs/tags/") : -3].partition("/")
            branch = heads.get(sha)
            if branch and (name is None or model == name):
                out.setdefault(model, {})[alias] = int(branch.rsplit("/v", 1)[1])
        return out

    def resolve(self, ref: Ref) -> Ref:
        """The concrete version a reference names (the newest when it names none)."""
        versions = self.versions(ref.name).get(ref.name)
        if not versions:
            known = ", ".join(self.versions()) or "none yet"
            raise RegistryError(f"no model named {ref.name!r} in {self.remote} (models: {known})")
        if ref.alias:
            version = self.aliases(ref.name).get(ref.name, {}).get(ref.alias)
            if version is None:
                raise RegistryError(
                    f"{ref} is not set; `clipforge registry promote {ref.name}@vN --alias {ref.alias}` sets it"
                )
            return Ref(ref.name, version=version)
        if ref.version is None:
            return Ref(ref.name, version=versions[-1])
        if ref.version not in versions:
            raise RegistryError(f"{ref} does not exist; {ref.name} has versions {', '.join(f'v{v}' for v in versions)}")
        return ref

    def record(self, ref: Ref) -> dict[str, Any]:
        """A version's model.yaml."""
        ref = self.resolve(ref)
        with self._clone(ref.branch) as repo:
            return yaml.safe_load(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.yaml"))

    def card(self, ref: Ref) -> str:
        ref = self.resolve(ref)
        with self._clone(ref.branch) as repo:
            return repo.git.show(f"origin/{ref.branch}:{ref.name}/MODEL.md")

    # -- writing -------------------------------------------------------------------
    def push(self, run_dir: Path, name: str, attempts: int = 50) -> Ref:
        """A new version of ``name`` from a finished run; the next free number, retried if another push takes it."""
        Ref.parse(name)
        run_dir = RunDir(run_dir)
        if not run_dir.is_finished():
            raise RegistryError(
                f"{run_dir} is not a finished run: it has no final weights and run record; train it to the end first"
            )
        run, config, weights = run_dir.record(), run_dir.config(), run_dir.weights
        self.steps = {}
        started = time.perf_counter()
        with self._clone("main", share_store=True) as repo:
            self._step("clone of main (no checkout of weights)", started)
            stored: tuple[str, int] | None = None
            for _ in range(attempts):
                started = time.perf_counter()
                self._git(repo, "fetch", "origin", "+refs/heads/main:refs/remotes/origin/main")
                taken = self.versions(name).get(name, [])
                self._step("fetch of main, ls-remote of versions", started)
                version = (taken[-1] if taken else 0) + 1
                ref = Ref(name, version=version)
                record = {
                    "name": name,
                    "version": version,
                    "parent": f"{name}@v{taken[-1]}" if taken else None,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
                        record[how] = getattr(run, how)
                repo.git.checkout("-B", ref.branch, "origin/main")
                folder = Path(repo.working_tree_dir) / name
                folder.mkdir(exist_ok=True)
                if stored is None:
                    started = time.perf_counter()
                    stored = self._store_object(repo, weights)
                    self._step("sha256 and copy into the LFS store", started)
                started = time.perf_counter()
                digest, size = stored
                self._stage_pointer(repo, f"{name}/model.safetensors", _pointer(digest, size))
                record["files"] = {"model.safetensors": {"sha256": digest, "size": size}}
                (folder / "model.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
                (folder / "MODEL.md").write_text(model_card(record))
                repo.git.add(f"{name}/model.yaml", f"{name}/MODEL.md")
                # The trailer is what the remote's hook checks a new version branch for.
                repo.git.commit("-m", f"{name} v{version}\n\n{protect.TRAILER}: {ref}", env=AUTHOR)
                entry = {
                    "version": version,
                    "commit": repo.head.commit.hexsha,
                    "sha256": digest,
                    "size": record["files"]["model.safetensors"]["size"],
                    "by": _who(),
                    "at": record["created"],
                }
                repo.git.checkout("-B", "main", "origin/main")
                _append_jsonl(Path(repo.working_tree_dir) / "models" / name / "versions.jsonl", entry)
                repo.git.add(f"models/{name}/versions.jsonl")
                repo.git.commit("-m", f"ledger: {ref} at {entry['commit'][:12]}", env=AUTHOR)
                self._step("record, card and ledger: git add and two commits", started)
                started = time.perf_counter()
                try:
                    self._git(repo, "push", "--atomic", "origin", f"{ref.branch}:{ref.branch}", "main:main")
                    self._step("git push --atomic (git-lfs pre-push, the remote's hooks)", started)
                    return ref
                except RegistryError as exc:
                    if not _lost_race(exc):
                        raise
                    # Another push took this number or moved main; its loser's LFS upload is an orphan for `gc`.
            raise RegistryError(f"gave up pushing {name} after {attempts} attempts: too many concurrent pushes")

    def promote(
        self, ref: Ref, alias: str, expect: int | None | str = "current", why: str = "", attempts: int = 20
    ) -> Ref:
        """Point alias ``<name>/<alias>`` at a version, with compare-and-swap, and record the move.

        ``expect`` is the version the caller believes the alias points to (None: unset);
        by default, whatever it points to when we look. If another promotion moved it
        in between, the push's lease fails and nothing changes. ``main``'s
        ``aliases.yaml`` and ``history.jsonl`` change in the same atomic push as the tag.
        """
        Ref.parse(f"{ref.name}@{alias}")
        ref = self.resolve(ref)
        tag = f"refs/tags/{ref.name}/{alias}"
        seen = self.aliases(ref.name).get(ref.name, {}).get(alias)
        if expect != "current" and seen != expect:
            raise RegistryError(
                f"{ref.name}@{alias} points to {f'v{seen}' if seen else 'nothing'}, not "
                f"{f'v{expect}' if expect else 'nothing'} as expected: someone promoted meanwhile; look and retry"
            )
        with self._clone(ref.branch) as repo:
            for _ in range(attempts):
                old = self._ls_remote("--tags", f"{tag}*").get(tag, "")
                current = self.aliases(ref.name).get(ref.name, {}).get(alias)
                if current != seen:
                    raise RegistryError(
                        f"{ref.name}@{alias} was moved by someone else while promoting {ref}; check `clipforge "
                        f"registry list {ref.name}` and retry"
                    )
                self._git(repo, "fetch", "origin", "+refs/heads/main:refs/remotes/origin/main")
                repo.git.checkout("-B", "main", "origin/main")
                self._record_move(repo, ref, alias, current, why, via="promote")
                repo.git.tag(
                    "-f",
                    "-a",
                    f"{ref.name}/{alias}",
                    f"origin/{ref.branch}",
                    "-m",
                    f"{ref.name} {alias}: v{ref.version}",
                    env=AUTHOR,
                )
                try:
                    self._git(
                        repo,
                        "push",
                        "--atomic",
                        f"--force-with-lease={tag}:{old}",
                        "origin",
                        f"{tag}:{tag}",
                        "main:main",
                    )
                    return ref
                except RegistryError as exc:
                    if "stale info" in exc.detail:
                        raise RegistryError(
                            f"{ref.name}@{alias} was moved by someone else while promoting {ref}; check `clipforge "
                            f"registry list {ref.name}` and retry"
                        ) from exc
                    if not _lost_race(exc):
                        raise
        raise RegistryError(f"gave up promoting {ref} after {attempts} attempts: main keeps moving")

    def propose(self, ref: Ref, alias: str, why: str = "", against: str | None = None) -> tuple[str, str]:
        """A promotion as a pull request: branch ``promote/<name>/<alias>/v<N>`` changing ``main``'s alias file.

        Returns (branch, review text for its body). Merging the branch into ``main`` (on the host, or with
        plain git) is what moves the alias: the remote's hook, or ``registry sync`` on a hosted remote.
        """
        Ref.parse(f"{ref.name}@{alias}")
        ref = self.resolve(ref)
        current = self.aliases(ref.name).get(ref.name, {}).get(alias)
        branch = f"promote/{ref.name}/{alias}/v{ref.version}"
        with self._clone("main") as repo:
            repo.git.checkout("-B", branch, "origin/main")
            self._record_move(repo, ref, alias, current, why, via=f"pull request {branch}")
            self._git(repo, "push", "--force", "origin", f"{branch}:{branch}")
        return branch, self.review(ref, against or alias)

    def _record_move(self, repo: git.Repo, ref: Ref, alias: str, current: int | None, why: str, via: str) -> None:
        """Commit, on the checked-out branch, ``aliases.yaml`` naming the new version and a line of history."""
        folder = Path(repo.working_tree_dir) / "models" / ref.name
        folder.mkdir(parents=True, exist_ok=True)
        aliases = _read_aliases(folder / "aliases.yaml")
        aliases[alias] = ref.version
        (folder / "aliases.yaml").write_text("".join(f"{a}: {v}\n" for a, v in sorted(aliases.items())))
        move = {
            "alias": alias,
            "from": current,
            "to": ref.version,
            "by": _who(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "why": why,
            "via": via,
        }
        _append_jsonl(folder / "history.jsonl", move)
        repo.git.add(f"models/{ref.name}")
        moved = f"v{current}" if current else "unset"
        repo.git.commit(
            "-m", f"{ref.name}@{alias}: {moved} -> v{ref.version}" + (f"\n\n{why}" if why else ""), env=AUTHOR
        )

    def history(self, name: str) -> list[dict[str, Any]]:
        """Every alias move of ``name``, oldest first, with the commit on ``main`` that made it and its committer
        (for a merged pull request: who merged it, and when)."""
        Ref.parse(name)
        path = f"models/{name}/history.jsonl"
        with self._clone("main") as repo:
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

    def sync(self) -> list[str]:
        """Point every alias tag at what ``main``'s alias files say (after a pull request merged on a host that
        runs no hooks); compare-and-swap per tag. Returns the moves made."""
        moved = []
        with self._clone("main") as repo:
            root = Path(repo.working_tree_dir) / "models"
            wanted = {
                (folder.name, alias): version
                for folder in (sorted(root.iterdir()) if root.is_dir() else [])
                for alias, version in _read_aliases(folder / "aliases.yaml").items()
            }
            have = self.aliases()
            for (name, alias), version in sorted(wanted.items()):
                if have.get(name, {}).get(alias) == version:
                    continue
                ref = Ref(name, version=version)
                tag = f"refs/tags/{name}/{alias}"
                old = self._ls_remote("--tags", f"{tag}*").get(tag, "")
                self._git(repo, "fetch", "origin", f"+refs/heads/{ref.branch}:refs/remotes/origin/{ref.branch}")
                repo.git.tag(
                    "-f",
                    "-a",
                    f"{name}/{alias}",
                    f"origin/{ref.branch}",
                    "-m",
                    f"{name} {alias}: v{version}",
                    env=AUTHOR,
                )
                self._git(repo, "push", f"--force-with-lease={tag}:{old}", "origin", f"{tag}:{tag}")
                moved.append(f"{name}@{alias} -> v{version}")
        return moved

    def pull(self, ref: Ref, to: Path) -> list[str]:
        """Fetch one version's files (only its LFS objects), verify the weights' sha256, copy them to ``to``.

        Returns the LFS object ids that were downloaded.
        """
        ref = self.resolve(ref)
        if self._local_bare() is not None:
            return self._pull_local(ref, Path(to))
        with self._clone(ref.branch) as repo:
            record = yaml.safe_load(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.yaml"))
            # `git lfs fetch origin models/x/v1` answers "Invalid ref argument": name the remote-tracking ref.
            try:
                self._git(
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
            oid = _pointer_oid(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.safetensors"))
            expected = record["files"]["model.safetensors"]["sha256"]
            if oid != expected:
                raise RegistryError(
                    f"{ref}: the weights' sha256 {oid[:12]}... is not the one its record names ({expected[:12]}...); "
                    "refusing them"
                )
            objects = Path(repo.git_dir) / "lfs" / "objects"
            fetched = sorted(p.name for p in objects.glob("*/*/*"))
            to = Path(to)
            to.mkdir(parents=True, exist_ok=True)
            # The verified object itself becomes the file: one move, no checkout copy.
            shutil.move(objects / oid[:2] / oid[2:4] / oid, to / "model.safetensors")
            for file in ("model.yaml", "MODEL.md"):
                (to / file).write_text(repo.git.show(f"origin/{ref.branch}:{ref.name}/{file}") + "\n")
        return fetched

    def _pull_local(self, ref: Ref, to: Path) -> list[str]:
        """Pull from a bare repository on a reachable filesystem: one pass that copies and hashes the object.

        git-lfs would copy the object into a clone (hashing it), then check it out (a second copy); the
        object is a plain file in the remote's store (``lfs/objects/OID[0:2]/OID[2:4]/OID``), so one read,
        hashed as it is written out, is the floor. A changed object is refused as git-lfs refuses it. The
        version's files are read from the bare repository itself (read-only): no clone.
        """
        bare = self._local_bare()

        def show(path: str) -> str:
            try:
                return git.Git().execute(["git", "--git-dir", str(bare), "show", f"refs/heads/{ref.branch}:{path}"])
            except git.GitCommandError as exc:
                raise RegistryError(f"{ref}: cannot read {path} from {self.remote}: {_last_line(exc)}") from None

        record = yaml.safe_load(show(f"{ref.name}/model.yaml"))
        oid = _pointer_oid(show(f"{ref.name}/model.safetensors"))
        expected = record["files"]["model.safetensors"]["sha256"]
        if oid != expected:
            raise RegistryError(
                f"{ref}: the weights' sha256 {oid[:12]}... is not the one its record names ({expected[:12]}...); "
                "refusing them"
            )
        source = bare / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        if not source.exists():
            raise RegistryError(f"{ref}: the registry has no LFS object {oid[:12]}... for its weights; push it again")
        to.mkdir(parents=True, exist_ok=True)
        partial = to / "model.safetensors.partial"
        digest = hashlib.sha256()
        with open(source, "rb") as f, open(partial, "wb") as out:
            while chunk := f.read(1 << 23):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != oid:
            partial.unlink()
            raise RegistryError(
                f"{ref}: the stored weights do not match their sha256 (changed in the remote's LFS store); "
                "refusing them"
            )
        os.replace(partial, to / "model.safetensors")
        for file in ("model.yaml", "MODEL.md"):
            (to / file).write_text(show(f"{ref.name}/{file}") + "\n")
        return [oid]

    def _step(self, name: str, started: float) -> None:
        self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - started

    def _store_object(self, repo: git.Repo, weights: Path) -> tuple[str, int]:
        """Put the weights into the clone's LFS store (the remote's own, for a bare path): one hash, one copy.

        ``git add`` would run git-lfs's clean filter, which hashes with Go's software SHA-256 (git-lfs 3.3,
        Go 1.19: about 170 MB/s here) and reaches git through a pipe: 4-5 s for 500 MB, against 0.5 s for
        OpenSSL's SHA-256 with the CPU's SHA instructions. So the weights are hashed here, then copied in
        the kernel to their place in the store's documented layout (``objects/OID[0:2]/OID[2:4]/OID``), and
        git gets the pointer; git-lfs still does every transfer.
        """
        storage = repo.git.config("--local", "--default", "", "lfs.storage") or str(Path(repo.git_dir) / "lfs")
        tmp_dir = Path(storage) / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        before = weights.stat()
        digest = hashlib.sha256()
        with open(weights, "rb") as f:
            while chunk := f.read(1 << 23):
                digest.update(chunk)
        # A new name, not mkstemp's empty file: copying over an existing file measured 1.2-1.4x slower here.
        tmp = tmp_dir / f"push-{os.getpid()}-{secrets.token_hex(8)}"
        shutil.copyfile(weights, tmp)  # in the kernel (copy_file_range), faster than writing from Python
        after = weights.stat()
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            os.unlink(tmp)
            raise RegistryError(f"{weights} changed while it was being pushed; push again once it is written")
        size = after.st_size
        oid = digest.hexdigest()
        target = Path(storage) / "objects" / oid[:2] / oid[2:4] / oid
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            os.unlink(tmp)  # the same weights were pushed before: the object is there already
        else:
            os.replace(tmp, target)
        return oid, size

    def _local_bare(self) -> Path | None:
        """The remote's directory when it is a bare repository on a filesystem this machine sees."""
        remote = self.remote.removeprefix("file://")
        if "://" in remote or not (Path(remote) / "HEAD").is_file():
            return None
        return Path(remote)

    def review(self, ref: Ref, against: str | None = "production", weights_too: bool = True) -> str:
        """The pull-request body for a version, compared with an alias (or its parent when the alias is unset)."""
        ref = self.resolve(ref)
        new = self.record(ref)
        base = None
        if against:
            try:
                base = self.record(self.resolve(Ref(ref.name, alias=against)))
            except RegistryError:
                base = None
        if base is None and new.get("parent"):
            base = self.record(Ref.parse(new["parent"]))
        weights = None
        if base is not None and weights_too:
            weights = self.weight_changes(Ref(base["name"], version=base["version"]), ref)
        return review_text(new, base, against, weights)

    def verify(self) -> tuple[list[str], dict[str, int]]:
        """Check any remote after the fact; returns (problems, counts). Each problem names the version or alias.

        Versions are checked against the ledger on ``main`` (commit and sha256 as pushed); each version's
        weights are fetched and hashed; every alias must point at a released version and agree with ``main``.
        """
        problems: list[str] = []
        heads = self._ls_remote("--heads", "refs/heads/models/*")
        tags = self._ls_remote("--tags", "refs/tags/*")
        with self._clone("main") as repo:
            ledger: dict[str, dict[str, Any]] = {}
            wanted: dict[tuple[str, str], int] = {}
            root = Path(repo.working_tree_dir) / "models"
            for folder in sorted(root.iterdir()) if root.is_dir() else []:
                for line in (
                    (folder / "versions.jsonl").read_text().splitlines() if (folder / "versions.jsonl").exists() else []
                ):
                    entry = json.loads(line)
                    ledger[f"refs/heads/models/{folder.name}/v{entry['version']}"] = {**entry, "name": folder.name}
                for alias, version in _read_aliases(folder / "aliases.yaml").items():
                    wanted[(folder.name, alias)] = version
            for branch, entry in sorted(ledger.items()):
                ref = Ref(entry["name"], version=entry["version"])
                now = heads.get(branch)
                if now is None:
                    problems.append(f"{ref}: its branch was deleted (pushed as {entry['commit'][:12]})")
                elif now != entry["commit"]:
                    problems.append(
                        f"{ref}: rewritten after its push: the branch is at {now[:12]}, "
                        f"pushed as {entry['commit'][:12]}"
                    )
            for branch in sorted(set(heads) - set(ledger)):
                name, version = branch.removeprefix("refs/heads/models/").rsplit("/v", 1)
                problems.append(f"{name}@v{version}: not in the ledger (pushed behind the registry's back)")
            for branch, entry in sorted(ledger.items()):
                if heads.get(branch) is None:
                    continue
                problems += self._verify_weights(repo, Ref(entry["name"], version=entry["version"]), entry)
            released = {heads[b]: b for b in heads}
            for ref, sha in sorted(tags.items()):
                if not ref.endswith("^{}"):
                    continue
                tag = ref[len("refs/tags/") : -3]
                name, _, alias = tag.partition("/")
                branch = released.get(sha)
                if branch is None or not branch.startswith(f"refs/heads/models/{name}/v"):
                    problems.append(
                        f"{name}@{alias}: the tag points at {sha[:12]}, which is no released version of {name}"
                    )
                    continue
                version = int(branch.rsplit("/v", 1)[1])
                if (name, alias) in wanted and wanted[(name, alias)] != version:
                    problems.append(
                        f"{name}@{alias}: main's aliases.yaml names v{wanted[(name, alias)]} but the tag points at "
                        f"v{version}; run clipforge registry sync"
                    )
        return problems, {"versions": len(heads), "aliases": sum(1 for r in tags if r.endswith("^{}"))}

    def _verify_weights(self, repo: git.Repo, ref: Ref, entry: dict[str, Any]) -> list[str]:
        """Fetch one version's weights and hash them: against the pointer, the record and the ledger."""
        self._git(repo, "fetch", "origin", f"+refs/heads/{ref.branch}:refs/remotes/origin/{ref.branch}")
        path = f"{ref.name}/model.safetensors"
        oid = _pointer_oid(repo.git.show(f"origin/{ref.branch}:{path}"))
        record = yaml.safe_load(repo.git.show(f"origin/{ref.branch}:{ref.name}/model.yaml"))
        recorded = record["files"]["model.safetensors"]["sha256"]
        if not oid == recorded == entry["sha256"]:
            return [
                f"{ref}: the weights' pointer says {oid[:12]}, model.yaml {recorded[:12]}, "
                f"the ledger {entry['sha256'][:12]}"
            ]
        try:
            self._git(repo, "lfs", "fetch", "origin", f"origin/{ref.branch}", "--include", path)
        except RegistryError as exc:
            return [f"{ref}: its weights could not be fetched or do not match their sha256 {oid[:12]}: {exc}"]
        stored = Path(repo.git_dir) / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        if not stored.exists():
            return [f"{ref}: the remote has no LFS object {oid[:12]} for its weights"]
        digest = hashlib.sha256()
        with open(stored, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != oid:
            return [f"{ref}: its weights hash to {digest.hexdigest()[:12]}, not their recorded sha256 {oid[:12]}"]
        stored.unlink()  # one version's weights on disk at a time
        return []

    def weight_changes(self, a: Ref, b: Ref) -> dict[str, Any]:
        """Tensor by tensor, how ``b``'s weights differ from ``a``'s (both pulled and verified first)."""
        with tempfile.TemporaryDirectory(prefix="clipforge-weights-") as tmp:
            self.pull(a, Path(tmp) / "a")
            self.pull(b, Path(tmp) / "b")
            return weight_diff(Path(tmp) / "a" / "model.safetensors", Path(tmp) / "b" / "model.safetensors")

    def diff(self, a: Ref, b: Ref) -> dict[str, Any]:
        """Metric, config and size differences between two versions."""
        ra, rb = self.record(a), self.record(b)
        metrics = {k: (ra["metrics"].get(k), rb["metrics"].get(k)) for k in rb["metrics"]}
        config = {
            k: (v1, v2) for k, v1, v2 in config_changes(ra.get("training_config", {}), rb.get("training_config", {}))
        }
        sizes = (ra["files"]["model.safetensors"]["size"], rb["files"]["model.safetensors"]["size"])
        return {"metrics": metrics, "config": config, "size": sizes}

    def gc(self) -> list[str]:
        """Delete LFS objects no branch or tag refers to (left by lost push races); bare path remotes only."""
        store = self._bare_path() / "lfs" / "objects"
        if not store.is_dir():
            return []
        with self._clone("main", all_refs=True) as repo:
            listing = self._git(repo, "lfs", "ls-files", "--all", "--long")
        referenced = {line.split()[0] for line in listing.splitlines() if line.strip()}
        removed = []
        for path in store.glob("*/*/*"):
            if path.is_file() and path.name not in referenced:
                path.unlink()
                removed.append(path.name)
        return removed

    # -- plumbing ------------------------------------------------------------------------
    def _bare_path(self) -> Path:
        remote = self.remote.removeprefix("file://")
        if "://" in remote:
            raise RegistryError(
                f"gc works on a bare repository path, not {self.remote}; clean an LFS server with its own tools"
            )
        return Path(remote)

    def _env(self, skip_smudge: bool = False) -> dict[str, str]:
        env = {"GIT_TERMINAL_PROMPT": "0", **AUTHOR}
        if skip_smudge:
            env["GIT_LFS_SKIP_SMUDGE"] = "1"
        return env

    def _configure(self, repo: git.Repo) -> None:
        repo.git.lfs("install", "--local", "--skip-smudge")
        if self.lfs_url:
            repo.git.config("--local", "lfs.url", self.lfs_url)
        # A bare repository path needs no LFS server: git-lfs uses its standalone file transfer.

    @contextlib.contextmanager
    def _clone(self, branch: str, all_refs: bool = False, share_store: bool = False) -> Iterator[git.Repo]:
        """A throw-away clone with LFS smudging off: instant, and no weights downloaded.

        ``share_store`` (pushes): for a bare repository on a reachable filesystem, the clone's LFS store is the
        remote's own, so the weights are hashed and written once, straight into the registry, and
        the push finds them there instead of copying them a second time. A push that loses its race leaves
        its object there as an orphan, which ``gc`` removes.
        """
        tmp = tempfile.mkdtemp(prefix="clipforge-registry-")
        try:
            try:
                # The -c options are ours (the LFS filter), never user input; GitPython blocks -c unless told.
                repo = git.Repo.clone_from(
                    self.remote,
                    tmp,
                    multi_options=[
                        *(f"--config {shlex.quote(f'{k}={v}')}" for k, v in LFS_CONFIG.items()),
                        "--no-checkout",
                    ],
                    env=self._env(skip_smudge=True),
                    allow_unsafe_options=True,
                )
            except git.GitCommandError as exc:
                raise RegistryError(f"cannot reach the registry at {self.remote}: {_last_line(exc)}") from None
            self._configure(repo)
            bare = self._local_bare() if share_store else None
            if bare is not None:
                repo.git.config("--local", "lfs.storage", str(bare.resolve() / "lfs"))
            if branch != "main":
                repo.git.fetch(
                    "origin", f"+refs/heads/{branch}:refs/remotes/origin/{branch}", env=self._env(skip_smudge=True)
                )
            if all_refs:
                repo.git.fetch(
                    "origin",
                    "+refs/heads/*:refs/remotes/origin/*",
                    "+refs/tags/*:refs/tags/*",
                    env=self._env(skip_smudge=True),
                )
            repo.git.checkout("-B", "main", "origin/main", env=self._env(skip_smudge=True))
            yield repo
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _git(self, repo: git.Repo, *args: str) -> str:
        try:
            return repo.git.execute(["git", *LFS_FILTER, *args], env={**os.environ, **self._env()})
        except git.GitCommandError as exc:
            raise RegistryError(
                f"git {args[0]} {' '.join(a for a in args[1:3])}: {_last_line(exc)}", detail=str(exc.stderr)
            ) from None

    def _ls_remote(self, *args: str) -> dict[str, str]:
        result = subprocess.run(
            ["git", "ls-remote", *args[:-1], self.remote, args[-1]],
            capture_output=True,
            text=True,
            env={**os.environ, **self._env()},
        )
        if result.returncode != 0:
            raise RegistryError(
                f"cannot reach the registry at {self.remote}: "
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'git ls-remote failed'}"
            )
        refs = {}
        for line in result.stdout.splitlines():
            sha, _, ref = line.partition("\t")
            refs[ref] = sha
        return refs

    def _stage_pointer(self, repo: git.Repo, path: str, pointer: str) -> None:
        """Stage ``path`` as the LFS pointer blob ``pointer`` (the work tree is left without it).

        ``git add`` would start git-lfs's clean filter, a Go process, only for it to pass the pointer
        through unchanged: the blob is written as is, the same bytes the filter gives git.
        """
        text = Path(repo.git_dir) / "clipforge-pointer"
        text.write_text(pointer)
        oid = repo.git.hash_object("-w", "--no-filters", str(text))
        repo.git.update_index("--add", "--cacheinfo", f"100644,{oid},{path}")


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def _read_aliases(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        alias, _, version = line.partition(":")
        if version.strip().isdigit():
            found[alias.strip()] = int(version)
    return found


def _lost_race(exc: RegistryError) -> bool:
    """Whether a push failed because someone else pushed first (a version number taken, ``main`` moved)."""
    signs = (
        "rejected",
        "already exists",
        "cannot lock ref",
        "failed to update ref",
        "atomic push failed",
        "fetch first",
    )
    return any(sign in exc.detail for sign in signs)


def _pointer_oid(pointer: str) -> str:
    match = re.search(r"^oid sha256:([0-9a-f]{64})$", pointer, re.MULTILINE)
    if match is None:
        raise RegistryError("the weights are not stored as an LFS pointer: the git-lfs filter did not run")
    return match.group(1)


def _pointer(oid: str, size: int) -> str:
    """A Git LFS pointer file (the spec's three lines)."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def _last_line(exc: git.GitCommandError) -> str:
    text = (exc.stderr or str(exc)).strip().strip("'").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("stderr:")]
    return lines[-1] if lines else "git failed"
