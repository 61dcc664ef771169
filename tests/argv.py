"""Command lines for the tests: flags from keywords, and the packing job under mpiexec."""

from __future__ import annotations

import sys
from pathlib import Path


def options(**values: object) -> list[str]:
    """Flags from keywords: ``clip_frames=8, split__train=0.6`` is ``--clip-frames 8 --split.train 0.6``."""
    argv: list[str] = []
    for key, value in values.items():
        argv += ["--" + key.replace("__", ".").replace("_", "-"), str(value)]
    return argv


def pack_argv(mpiexec: list[str], ranks: int, videos: Path, out: Path, *extra: str, **values: object) -> list[str]:
    """``mpiexec -n RANKS python -m clipforge.jobs.preprocess --videos V --out O`` and the options."""
    job = [sys.executable, "-m", "clipforge.jobs.preprocess"]
    return [*mpiexec, "-n", str(ranks), *job, *options(videos=videos, out=out, **values), *extra]
