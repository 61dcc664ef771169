"""Protecting a registry's history: server-side hooks for a bare repository, rules for hosted remotes.

A bare registry made by ``clipforge registry init`` refuses, for every pusher and
every client (plain git included):

- deleting or rewriting anything under ``refs/heads/`` (``receive.denyDeletes`` and
  ``receive.denyNonFastForwards``, the server's own checks, which hold even if the
  hooks are lost);
- any update of an existing version branch ``models/<name>/v<N>``, and a new one
  that does not carry the record ``registry push`` writes;
- deleting an alias tag ``<name>/<alias>``, or pointing it at anything but the tip
  of a released version of ``<name>``;
- a ``main`` whose alias files name versions that do not exist, or whose ledgers
  and alias histories lose lines (they are append-only).

The hooks are POSIX shell and git plumbing, so the machine that holds the
repository needs nothing but git. After ``main`` moves (a promotion pushed, or a
proposed promotion merged by plain git), the post-receive hook points the alias
tags at what ``main``'s alias files say, so merging is what moves an alias.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from clipforge.base.errors import UserError

HOOK_MARK = "clipforge registry hook"
TRAILER = "Registry-Version"

PRE_RECEIVE = r"""#!/bin/sh
# @MARK@: released versions and aliases cannot be rewritten or deleted.
zero=0000000000000000000000000000000000000000
status=0
refuse() {
  echo "clipforge registry: refused $1: $2" >&2
  status=1
}
appended() {  # $1 old commit, $2 new commit, $3 path: the new file starts with the whole old one
  git cat-file -e "$1:$3" 2>/dev/null || return 0
  size=$(git cat-file -s "$1:$3")
  [ "$(git cat-file -p "$2:$3" 2>/dev/null | head -c "$size" | git hash-object --stdin)" = "$(git rev-parse "$1:$3")" ]
}
while read -r old new ref; do
  case "$ref" in
    refs/heads/models/*/v*)
      spec=${ref#refs/heads/models/}
      name=${spec%/v*}
      version=${spec##*/v}
      if [ "$new" = "$zero" ]; then
        refuse "$ref" "$name@v$version is a released version and cannot be deleted; push a new version instead"
      elif [ "$old" != "$zero" ]; then
        refuse "$ref" "$name@v$version is a released version and cannot be rewritten; push a new version"
      elif ! git log -1 --format=%B "$new" | grep -qx "@TRAILER@: $name@v$version"; then
        refuse "$ref" "it lacks the record registry push writes; push versions with clipforge registry push"
      elif ! git cat-file -e "$new:$name/model.yaml" 2>/dev/null; then
        refuse "$ref" "it has no $name/model.yaml; push versions with clipforge registry push"
      fi
      ;;
    refs/tags/*/*)
      tag=${ref#refs/tags/}
      name=${tag%%/*}
      if [ "$new" = "$zero" ]; then
        refuse "$ref" "alias $tag cannot be deleted; point it at another version (clipforge registry promote)"
        continue
      fi
      target=$(git rev-parse --verify -q "$new^{commit}")
      released=$(git for-each-ref --format='%(objectname)' "refs/heads/models/$name/" | grep -x "$target")
      if [ -z "$target" ] || [ -z "$released" ]; then
        refuse "$ref" "alias $tag must point at a released version of $name; promote with clipforge registry promote"
      fi
      ;;
    refs/heads/main)
      [ "$new" = "$zero" ] && continue
      for file in $(git ls-tree -r --name-only "$new" -- models | grep '/aliases.yaml$'); do
        name=${file#models/}
        name=${name%/aliases.yaml}
        git cat-file -p "$new:$file" | sed -n 's/^\([a-z0-9._-]*\): *\([0-9][0-9]*\)$/\1 \2/p' |
          while read -r alias version; do
            if ! git rev-parse -q --verify "refs/heads/models/$name/v$version" >/dev/null; then
              echo "clipforge registry: refused $ref: $file points $alias at v$version," \
                "which is not a released version of $name" >&2
              exit 1
            fi
          done || status=1
      done
      if [ "$old" != "$zero" ]; then
        for file in $(git ls-tree -r --name-only "$old" -- models | grep -E '/(versions|history)\.jsonl$'); do
          appended "$old" "$new" "$file" ||
            refuse "$ref" "$file is append-only and this push removes or changes its lines"
        done
      fi
      ;;
  esac
done
exit $status
""".replace("@MARK@", HOOK_MARK).replace("@TRAILER@", TRAILER)

POST_RECEIVE = r"""#!/bin/sh
# @MARK@: after main moves, the alias tags follow main's alias files.
while read -r old new ref; do
  [ "$ref" = refs/heads/main ] || continue
  for file in $(git ls-tree -r --name-only "$new" -- models | grep '/aliases.yaml$'); do
    name=${file#models/}
    name=${name%/aliases.yaml}
    git cat-file -p "$new:$file" | sed -n 's/^\([a-z0-9._-]*\): *\([0-9][0-9]*\)$/\1 \2/p' |
      while read -r alias version; do
        target=$(git rev-parse -q --verify "refs/heads/models/$name/v$version") || continue
        current=$(git rev-parse -q --verify "refs/tags/$name/$alias^{commit}")
        if [ "$current" != "$target" ]; then
          git -c user.name="clipforge registry" -c user.email=registry@localhost \
            tag -f -a -m "$name $alias: v$version" "$name/$alias" "$target" >/dev/null &&
            echo "clipforge registry: $name@$alias -> v$version"
        fi
      done
  done
done
""".replace("@MARK@", HOOK_MARK)


class ProtectError(UserError):
    """The registry cannot be protected as asked; the message says what to change."""


def install(bare: Path, group: str | None = None) -> None:
    """Configure a bare registry repository so that its history cannot be rewritten, and set its group."""
    bare = Path(bare)
    if not (bare / "HEAD").exists() or not (bare / "refs").is_dir():
        raise ProtectError(f"{bare} is not a bare git repository; create the registry there with registry init")
    settings = {"receive.denyNonFastForwards": "true", "receive.denyDeletes": "true", "core.logAllRefUpdates": "true"}
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ProtectError(f"group {group!r} does not exist on this machine; give a group you are in") from None
        settings["core.sharedRepository"] = "group"
    for key, value in settings.items():
        subprocess.run(["git", "--git-dir", str(bare), "config", key, value], check=True)
    hooks = bare / "hooks"
    hooks.mkdir(exist_ok=True)
    for name, text in (("pre-receive", PRE_RECEIVE), ("post-receive", POST_RECEIVE)):
        (hooks / name).write_text(text)
        (hooks / name).chmod(0o775 if group else 0o755)
    if group is not None:
        # Files the team writes (objects, refs, LFS objects) belong to the group, and new ones inherit it.
        for path in [bare, *bare.rglob("*")]:
            os.chown(path, -1, gid, follow_symlinks=False)
            if path.is_dir():
                path.chmod(path.stat().st_mode | 0o2070)
            elif path.is_file():
                path.chmod(path.stat().st_mode | 0o060)


def is_protected(bare: Path) -> bool:
    hook = Path(bare) / "hooks" / "pre-receive"
    return hook.is_file() and HOOK_MARK in hook.read_text()


# --------------------------------------------------------------------------- hosted remotes
def hosted_rules(remote: str) -> tuple[str, list[list[str]], str]:
    """(host, the CLI commands that apply the same guarantees, what they do) for a GitHub or GitLab remote."""
    match = re.match(r"^(?:https://|ssh://git@|git@)([^/:]+)[/:]([^/]+)/([^/]+?)(?:\.git)?/?$", remote)
    if match is None:
        raise ProtectError(
            f"{remote} is not a GitHub or GitLab URL (https://HOST/OWNER/REPO or git@HOST:OWNER/REPO); "
            "a bare repository is protected by registry init"
        )
    host, owner, repo = match.groups()
    if "gitlab" in host:
        project = f"{owner}%2F{repo}"
        commands = [
            [
                "glab",
                "api",
                "-X",
                "POST",
                f"projects/{project}/protected_branches",
                "-f",
                f"name={pattern}",
                "-f",
                "push_access_level=30",
                "-f",
                "merge_access_level=30",
                "-f",
                "allow_force_push=false",
            ]
            for pattern in ("models/*", "main")
        ]
        what = (
            "version branches models/* and main take no force pushes and cannot be deleted (GitLab cannot "
            "refuse a fast-forward onto an existing version: registry verify reports one against the ledger); "
            "GitLab's protected tags can never move, so alias tags stay unprotected and main's aliases.yaml is "
            "the record: registry verify flags a tag that disagrees with it, registry sync repairs it"
        )
        return "gitlab", commands, what
    ruleset = {
        "name": "clipforge registry: released versions and aliases",
        "target": "branch",
        "enforcement": "active",
        "conditions": {"ref_name": {"include": ["refs/heads/models/**", "refs/heads/main"], "exclude": []}},
        "rules": [{"type": "deletion"}, {"type": "non_fast_forward"}],
    }
    versions = {
        "name": "clipforge registry: versions are never updated",
        "target": "branch",
        "enforcement": "active",
        "conditions": {"ref_name": {"include": ["refs/heads/models/**"], "exclude": []}},
        "rules": [{"type": "update"}],
    }
    tags = {
        "name": "clipforge registry: aliases are not deleted",
        "target": "tag",
        "enforcement": "active",
        "conditions": {"ref_name": {"include": ["refs/tags/*/*"], "exclude": []}},
        "rules": [{"type": "deletion"}],
    }
    commands = [
        ["gh", "api", "--method", "POST", f"repos/{owner}/{repo}/rulesets", "--input", "-", json.dumps(r)]
        for r in (ruleset, versions, tags)
    ]
    what = (
        "version branches and main cannot be deleted or force-pushed, a version branch cannot be updated, "
        "alias tags cannot be deleted; main stays open to fast-forward pushes, which registry push (the ledger) "
        "and promote make, so review promotions as pull requests (registry propose) by your team's rule"
    )
    return "github", commands, what


def apply_rules(commands: list[list[str]]) -> list[str]:
    """Run the host CLI's commands; the last argument of a ``--input -`` command is its standard input."""
    tool = commands[0][0]
    if shutil.which(tool) is None:
        raise ProtectError(f"{tool} is not installed: run the commands printed above by hand, or install {tool}")
    done = []
    for command in commands:
        argv, stdin = (command[:-1], command[-1]) if "--input" in command else (command, None)
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            raise ProtectError(f"{' '.join(argv[:4])}: {last}")
        done.append(" ".join(argv[:4]))
    return done
