"""Settings read from YAML into dataclasses: the one check that a mapping names only known fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .errors import UserError


def refuse_unknown(data: Mapping[str, Any], cls: type, where: str, error: type[UserError]) -> None:
    """Raise ``error`` naming the keys of ``data`` that are not fields of dataclass ``cls``, and the allowed ones."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = set(data) - set(allowed)
    if unknown:
        raise error(
            f"{where}: unknown setting(s) {', '.join(sorted(map(str, unknown)))}; allowed: {', '.join(allowed)}"
        )
