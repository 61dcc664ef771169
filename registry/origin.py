"""Running git against a registry's remote (``origin`` in every clone): throw-away clones, ``ls-remote``, and
git's failures turned into one line.

Every operation works in its own clone made with LFS smudging off (instant), and fetches only the LFS objects it
needs. clipforge never writes the user's global or system git config: the LFS filter is passed on the command
line and installed ``--local`` in each clone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import git

from .refs import RegistryError

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


def git_env(skip_smudge: bool = False) -> dict[str, str]:
    env = {"GIT_TERMINAL_PROMPT": "0", **AUTHOR}
    if skip_smudge:
        env["GIT_LFS_SKIP_SMUDGE"] = "1"
    return env


@dataclasses.dataclass(frozen=True)
class Origin:
    """A registry's remote URL (a bare repository path, ``file://``, ``git://`` or HTTP) and its LFS server."""

    url: str
    lfs_url: str | None = None

    def configure(self, repo: git.Repo) -> None:
        repo.git.lfs("install", "--local", "--skip-smudge")
        if self.lfs_url:
            repo.git.config("--local", "lfs.url", self.lfs_url)
        # A bare repository path needs no LFS server: git-lfs uses its standalone file transfer.

    @contextlib.contextmanager
    def clone(self, branch: str, all_refs: bool = False, share_store: bool = False) -> Iterator[git.Repo]:
        """A throw-away clone with LFS smudging off: instant, and no weights downloaded.

        ``share_store`` (pushes): for a bare repository on a reachable filesystem, the clone's LFS store is the
        remote's own, so the weights are hashed and written once, straight into the registry, and
        the push finds them there instead of copying them a second time. A push that loses its race leaves
        its object there as an orphan, which ``gc`` removes.
        """
        tmp = tempfile.mkdtemp(prefix="clipforge-registry-")
        quiet = git_env(skip_smudge=True)
        try:
            try:
                # The -c options are ours (the LFS filter), never user input; GitPython blocks -c unless told.
                repo = git.Repo.clone_from(
                    self.url,
                    tmp,
                    multi_options=[
                        *(f"--config {shlex.quote(f'{k}={v}')}" for k, v in LFS_CONFIG.items()),
                        "--no-checkout",
                    ],
                    env=quiet,
                    allow_unsafe_options=True,
                )
            except git.GitCommandError as exc:
                raise RegistryError(f"cannot reach the registry at {self.url}: {last_line(exc)}") from None
            self.configure(repo)
            bare = self.local_bare() if share_store else None
            if bare is not None:
                repo.git.config("--local", "lfs.storage", str(bare.resolve() / "lfs"))
            if branch != "main":
                repo.git.fetch("origin", f"+refs/heads/{branch}:refs/remotes/origin/{branch}", env=quiet)
            if all_refs:
                repo.git.fetch("origin", "+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*", env=quiet)
            repo.git.checkout("-B", "main", "origin/main", env=quiet)
            yield repo
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def ls_remote(self, *args: str) -> dict[str, str]:
        """``{ref: sha}`` from ``git ls-remote [options] URL pattern`` (the last argument is the pattern)."""
        result = subprocess.run(
            ["git", "ls-remote", *args[:-1], self.url, args[-1]],
            capture_output=True,
            text=True,
            env={**os.environ, **git_env()},
        )
        if result.returncode != 0:
            raise RegistryError(
                f"cannot reach the registry at {self.url}: "
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'git ls-remote failed'}"
            )
        refs = {}
        for line in result.stdout.splitlines():
            sha, _, ref = line.partition("\t")
            refs[ref] = sha
        return refs

    def local_bare(self) -> Path | None:
        """The remote's directory when it is a bare repository on a filesystem this machine sees."""
        remote = self.url.removeprefix("file://")
        if "://" in remote or not (Path(remote) / "HEAD").is_file():
            return None
        return Path(remote)

    def bare_path(self) -> Path:
        """The remote's directory, for the operations that only a bare repository path allows."""
        remote = self.url.removeprefix("file://")
        if "://" in remote:
            raise RegistryError(
                f"gc works on a bare repository path, not {self.url}; clean an LFS server with its own tools"
            )
        return Path(remote)


def run_git(repo: git.Repo, *args: str) -> str:
    """``git ARGS`` in ``repo`` with the LFS filter on; a failure is a :class:`RegistryError` of one line."""
    try:
        return repo.git.execute(["git", *LFS_FILTER, *args], env={**os.environ, **git_env()})
    except git.GitCommandError as exc:
        raise RegistryError(
            f"git {args[0]} {' '.join(a for a in args[1:3])}: {last_line(exc)}", detail=str(exc.stderr)
        ) from None


def lost_race(exc: RegistryError) -> bool:
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


def last_line(exc: git.GitCommandError) -> str:
    text = (exc.stderr or str(exc)).strip().strip("'").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("stderr:")]
    return lines[-1] if lines else "git failed"
