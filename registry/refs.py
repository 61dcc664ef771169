"""Naming in a registry: model names, the references users write (``name@v3``, ``name@production``), and the
git refs they live at (version branch ``models/<name>/v<N>``, alias tag ``<name>/<alias>``)."""

from __future__ import annotations

import dataclasses
import re

from clipforge.base.errors import UserError

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
VERSION_BRANCHES = "refs/heads/models/*"
"""The ``git ls-remote`` pattern of every version branch."""
BRANCH = re.compile(r"refs/heads/models/([^/]+)/v(\d+)")


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

    @classmethod
    def of_branch(cls, ref: str) -> Ref | None:
        """The version a full branch name (``refs/heads/models/<name>/v<N>``) holds; None for any other ref."""
        match = BRANCH.fullmatch(ref)
        return cls(match.group(1), version=int(match.group(2))) if match else None

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


def alias_tag(name: str, alias: str) -> str:
    """The full name of the tag that is alias ``alias`` of model ``name``."""
    return f"refs/tags/{name}/{alias}"


def peeled_alias(ref: str) -> tuple[str, str] | None:
    """(name, alias) of a peeled tag line of ``git ls-remote`` (``refs/tags/<name>/<alias>^{}``); None otherwise."""
    if not ref.startswith("refs/tags/") or not ref.endswith("^{}"):
        return None
    name, _, alias = ref[len("refs/tags/") : -3].partition("/")
    return name, alias
