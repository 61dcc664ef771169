"""The configuration reference, docs/reference/configuration.md, written from the jobs' own configs.

Every option of every job, with its value, default and help, read from the
parser tyro builds for the job (the same one its ``--help`` prints), so the
page cannot drift from the code: a test compares it with a fresh one.

    python -m clipforge.jobs.reference            # rewrite the page
    python -m clipforge.jobs.reference --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from pathlib import Path

import tyro

from clipforge.jobs.config import CONFIG_HELP

JOBS = ("preprocess", "train", "evaluate", "predict", "ps_train", "fl_train", "gpu_check", "selftest")
"""The jobs, in the order a user meets them: each is ``jobs/NAME.py`` with a ``Config``."""
PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md"
DEFAULT = re.compile(r"\s*\((default|required|fixed to)[^()]*(\([^()]*\)[^()]*)*\)\s*$", re.S)
"""tyro's "(default: ...)" at the end of a help text: the page gives the default a column of its own."""


def _parser(config: type) -> argparse.ArgumentParser:
    with warnings.catch_warnings():  # get_parser is tyro's one way to the parser it builds; deprecated, still kept
        warnings.simplefilter("ignore", DeprecationWarning)
        return tyro.extras.get_parser(config)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    found = re.search(r"\((default: .*)\)\s*$", action.help or "", re.S)
    if found:
        return f"`{_cell(found.group(1).removeprefix('default: '))}`"
    return "required" if action.required else ""


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices:
        choices = [str(c) for c in action.choices]
        if "None" in choices:  # tyro sets an optional Literal's choices in hash order: sorted, for a stable page
            choices = [*sorted(c for c in choices if c != "None"), "None"]
        return " \\| ".join(f"`{c}`" for c in choices)
    metavar = action.metavar if isinstance(action.metavar, str) else (action.dest or "").upper()
    return f"`{_cell(metavar)}`"


def job_section(name: str) -> str:
    """One job's options, grouped as its ``--help`` groups them."""
    module = importlib.import_module(f"clipforge.jobs.{name}")
    config = module.Config
    doc = " ".join((config.__doc__ or "").split())
    lines = [f"## `{name}`", "", f"`python jobs/{name}.py [OPTIONS]`: {doc}", ""]
    lines += [f"`{CONFIG_HELP.split('  ')[0]}`: {CONFIG_HELP.split('  ', 1)[1].strip()}.", ""]
    for group in _parser(config)._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "general"
        lines += [f"### {name}: {title.removesuffix(' options')}", "", "| option | value | default | what it does |"]
        lines += ["|---|---|---|---|"]
        for action in actions:
            flags = ", ".join(f"`{f}`" for f in action.option_strings)
            what = _cell(DEFAULT.sub("", action.help or ""))
            lines.append(f"| {flags} | {_value(action)} | {_default(action)} | {what} |")
        lines.append("")
    return "\n".join(lines)


def markdown() -> str:
    """The whole page."""
    head = [
        "# Configuration reference",
        "",
        "Every option of every job, generated from the jobs' configs by `python -m clipforge.jobs.reference`",
        "(do not edit by hand). Each job also takes `--config FILE.yaml`: its keys are the option names, and flags",
        "given on the command line override it. `--help` on any job prints the same options.",
        "",
        "Jobs: " + ", ".join(f"[`{name}`](#{name})" for name in JOBS) + ".",
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(job_section(name) for name in JOBS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = markdown()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python -m clipforge.jobs.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
