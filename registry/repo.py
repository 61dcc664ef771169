"""A model registry: a Git repository whose weights live in Git LFS, one branch per version.

``main`` holds a README and ``.gitattributes``; version N of model ``name`` is
branch ``models/<name>/v<N>`` with ``<name>/model.safetensors`` (LFS),
``<name>/model.yaml`` (the machine record) and ``<name>/MODEL.md`` (the card
a reviewer reads). Aliases (``production``, ``staging``) are annotated tags
``<name>/<alias>``, moved with compare-and-swap. ``main`` also keeps the
registry's own records (:mod:`.ledger`), and :mod:`.protect` makes a bare
remote refuse any rewrite of all this.

:class:`Registry` is what callers use; each of its ideas lives in its own
module: naming (:mod:`.refs`), running git (:mod:`.origin`), LFS objects
(:mod:`.lfs`), a version's push and pull (:mod:`.versions`), aliases
(:mod:`.aliases`) and auditing (:mod:`.audit`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import git
import yaml

from . import aliases, audit, protect, versions
from .card import config_changes, review_text, weight_diff
from .lfs import WEIGHT_PATTERNS
from .origin import AUTHOR, Origin, run_git
from .refs import Ref, RegistryError
from .versions import OnStep

README = (
    "# Model registry\n\nEach model version is a branch `models/<name>/v<N>`; aliases are tags "
    "`<name>/<alias>` (`git checkout <name>/production`).\n"
    "`models/<name>/` on this branch holds the ledger of versions (`versions.jsonl`), which version "
    "each alias names (`aliases.yaml`; a pull request changing it is a promotion) and every alias "
    "move (`history.jsonl`).\n"
    "Weights are stored with Git LFS. Managed with `clipforge registry`.\n"
)


class Registry:
    """A registry reached through its remote URL (a bare repository path, ``file://``, ``git://`` or HTTP)."""

    def __init__(self, remote: str, lfs_url: str | None = None) -> None:
        if shutil.which("git-lfs") is None:
            raise RegistryError("git-lfs is not installed: install it (Debian: apt-get install git-lfs) and retry")
        self.remote = str(remote)
        self.lfs_url = lfs_url
        self.origin = Origin(self.remote, lfs_url)

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
            registry.origin.configure(repo)
            (Path(tmp) / ".gitattributes").write_text(
                "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in WEIGHT_PATTERNS)
            )
            (Path(tmp) / "README.md").write_text(README)
            repo.git.add(".gitattributes", "README.md")
            repo.git.commit("-m", "Start the model registry", env=AUTHOR)
            repo.create_remote("origin", registry.remote)
            run_git(repo, "push", "origin", "main")
        return registry

    # -- reading -------------------------------------------------------------------
    def versions(self, name: str | None = None) -> dict[str, list[int]]:
        """Versions of every model (or of ``name``), from one ``git ls-remote``: no clone, no download."""
        return versions.numbers(self.origin, name)

    def aliases(self, name: str | None = None) -> dict[str, dict[str, int]]:
        """``{name: {alias: version}}`` from the alias tags (peeled to the version branch's commit)."""
        return aliases.versions(self.origin, name)

    def resolve(self, ref: Ref) -> Ref:
        """The concrete version a reference names (the newest when it names none)."""
        known = self.versions(ref.name).get(ref.name)
        if not known:
            models = ", ".join(self.versions()) or "none yet"
            raise RegistryError(f"no model named {ref.name!r} in {self.remote} (models: {models})")
        if ref.alias:
            version = self.aliases(ref.name).get(ref.name, {}).get(ref.alias)
            if version is None:
                raise RegistryError(
                    f"{ref} is not set; `clipforge registry promote {ref.name}@vN --alias {ref.alias}` sets it"
                )
            return Ref(ref.name, version=version)
        if ref.version is None:
            return Ref(ref.name, version=known[-1])
        if ref.version not in known:
            raise RegistryError(f"{ref} does not exist; {ref.name} has versions {', '.join(f'v{v}' for v in known)}")
        return ref

    def record(self, ref: Ref) -> dict[str, Any]:
        """A version's model.yaml."""
        return yaml.safe_load(versions.show(self.origin, self.resolve(ref), "model.yaml"))

    def card(self, ref: Ref) -> str:
        return versions.show(self.origin, self.resolve(ref), "MODEL.md")

    def history(self, name: str) -> list[dict[str, Any]]:
        """Every alias move of ``name``, oldest first, with the commit on ``main`` that made it and its committer
        (for a merged pull request: who merged it, and when)."""
        Ref.parse(name)
        return aliases.history(self.origin, name)

    def pull(self, ref: Ref, to: Path) -> list[str]:
        """Fetch one version's files (only its LFS objects), verify the weights' sha256, copy them to ``to``.

        Returns the LFS object ids that were downloaded.
        """
        return versions.pull(self.origin, self.resolve(ref), Path(to))

    # -- writing -------------------------------------------------------------------
    def push(self, run_dir: Path, name: str, attempts: int = 50, on_step: OnStep | None = None) -> Ref:
        """A new version of ``name`` from a finished run; the next free number, retried if another push takes it.

        ``on_step(step, seconds)``, when given, is told where the push's time goes.
        """
        return versions.push(self.origin, Path(run_dir), name, attempts, on_step)

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
        return aliases.promote(self.origin, self.resolve(ref), alias, expect, why, attempts)

    def propose(self, ref: Ref, alias: str, why: str = "", against: str | None = None) -> tuple[str, str]:
        """A promotion as a pull request: branch ``promote/<name>/<alias>/v<N>`` changing ``main``'s alias file.

        Returns (branch, review text for its body). Merging the branch into ``main`` (on the host, or with
        plain git) is what moves the alias: the remote's hook, or ``registry sync`` on a hosted remote.
        """
        Ref.parse(f"{ref.name}@{alias}")
        ref = self.resolve(ref)
        branch = aliases.propose(self.origin, ref, alias, why)
        return branch, self.review(ref, against or alias)

    def sync(self) -> list[str]:
        """Point every alias tag at what ``main``'s alias files say (after a pull request merged on a host that
        runs no hooks); compare-and-swap per tag. Returns the moves made."""
        return aliases.sync(self.origin)

    # -- comparing -----------------------------------------------------------------
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

    # -- auditing ------------------------------------------------------------------
    def verify(self) -> tuple[list[str], dict[str, int]]:
        """Check any remote after the fact; returns (problems, counts). Each problem names the version or alias.

        Versions are checked against the ledger on ``main`` (commit and sha256 as pushed); each version's
        weights are fetched and hashed; every alias must point at a released version and agree with ``main``.
        """
        return audit.verify(self.origin)

    def gc(self) -> list[str]:
        """Delete LFS objects no branch or tag refers to (left by lost push races); bare path remotes only."""
        return audit.gc(self.origin)
