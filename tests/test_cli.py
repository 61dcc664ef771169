"""The command line's shape: every subcommand runs a function, and every --help reads as the golden file says."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from clipforge.jobs.cli import build_parser

GOLDEN = Path(__file__).parent / "golden" / "cli-help.txt"


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The words of every command and subcommand, depth first in --help's order, and the parser of each."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                yield from commands(sub, (*words, word))


def every_help() -> str:
    """Each command's --help under a ``$ clipforge ... --help`` line, at a fixed 120-column width."""
    with mock.patch.dict(os.environ, {"COLUMNS": "120"}):
        return "".join(
            f"$ {' '.join(('clipforge', *words, '--help'))}\n{parser.format_help()}\n"
            for words, parser in commands(build_parser())
        )


def test_every_subcommand_runs_a_function() -> None:
    leaves = [(words, p) for words, p in commands(build_parser()) if not p._subparsers]
    assert len(leaves) > 20
    assert [words for words, p in leaves if not callable(p.get_default("func"))] == []


def test_every_help_matches_the_golden_file() -> None:
    assert every_help() == GOLDEN.read_text(), (
        "a --help text changed; if that is intended, refresh the golden file with\n"
        "  python -c 'from tests.test_cli import every_help; print(every_help(), end=\"\")' > tests/golden/cli-help.txt"
    )


def test_the_configuration_reference_is_the_one_the_jobs_configs_give() -> None:
    from clipforge.jobs import reference

    page = reference.markdown()
    assert "| `--batch-per-rank` | `INT` | `8` |" in page  # a row as the train job's parser gives it
    assert reference.PAGE.read_text() == page, (
        "docs/reference/configuration.md is stale: refresh it with python -m clipforge.jobs.reference"
    )
