"""Typed job configs: dataclasses, a YAML file, then the command line.

Precedence, lowest first: the dataclass defaults, ``--config FILE.yaml``, the
command-line flags. Every field's docstring is its ``--help`` text (tyro).
The resolved config is what a job saves into its run directory.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import tyro
import yaml

from clipforge.base.errors import UserError
from clipforge.base.logs import ERROR_PREFIX
from clipforge.base.settings import refuse_unknown

T = TypeVar("T")


class ConfigError(UserError):
    """A config file or value the job cannot use; the message names it and says what to change."""


def parse(cls: type[T], argv: list[str] | None = None) -> T:
    """Build ``cls`` from its defaults, an optional ``--config FILE`` and the command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    default = cls()
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        path, argv = _pop_config(argv)
        default = from_dict(cls, load_yaml(path), where=str(path))
    return tyro.cli(cls, args=argv, default=default, description=_description(cls))


CONFIG_HELP = (
    "--config FILE.yaml  start from the settings in this YAML file (its keys are the option names); flags override it"
)


def _description(cls: type) -> str:
    """The job's own description, then the one option tyro does not see."""
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(f"{cls.__name__}("):  # a dataclass without a docstring gets its signature as one
        doc = ""
    return f"{doc}\n\n{CONFIG_HELP}".strip()


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give the YAML file inside it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path} cannot be read ({exc.__class__.__name__}); give a readable YAML file"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    return data


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """A dataclass from a nested mapping; unknown keys are refused with the allowed ones listed."""
    hints = typing.get_type_hints(cls, include_extras=True)
    refuse_unknown(data, cls, where, ConfigError)
    values = {}
    for name, value in data.items():
        kind = _dataclass_in(hints[name])
        if kind is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {name} is a section; give it as a mapping of settings")
            value = from_dict(kind, value, where=f"{where}: {name}")
        elif isinstance(value, list) and _accepts_tuple(hints[name]):
            value = tuple(value)  # YAML has lists only
        elif isinstance(value, str) and _accepts(hints[name], Path):
            value = Path(value)  # YAML has strings only
        values[name] = value
    return cls(**values)


def to_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain data (paths as strings), for ``config.yaml`` in a run directory."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    return plain(dataclasses.asdict(config))


def guarded(main: Callable[[], Any]) -> Callable[[], int]:
    """Wrap a command's entry point so a user's mistake (any :class:`UserError`) prints one line and exits 2."""

    def run() -> int:
        try:
            result = main()
        except UserError as exc:
            print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("clipforge: interrupted", file=sys.stderr)
            return 130
        return result if isinstance(result, int) else 0

    return run


def _pop_config(argv: list[str]) -> tuple[Path, list[str]]:
    rest: list[str] = []
    path: Path | None = None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            value = next(it, None)
            if value is None:
                raise ConfigError("--config needs a YAML file path")
            path = Path(value)
        elif arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    assert path is not None
    return path, rest


def _accepts(hint: Any, kind: type) -> bool:
    """``hint`` is ``kind`` or a union with it (``Path | None``)."""
    return hint is kind or kind in typing.get_args(hint)


def _accepts_tuple(hint: Any) -> bool:
    return hint is tuple or typing.get_origin(hint) is tuple or any(_accepts_tuple(a) for a in typing.get_args(hint))


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass inside ``Annotated[...]`` or ``X | None``, if any."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in typing.get_args(hint):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None
