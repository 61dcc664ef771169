"""Logging that reads well in a Slurm output file.

One line per record, a timestamp, the rank, no colours and no carriage
returns when the output is not a terminal (progress bars included: see
:func:`progress_options`).
"""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Configure the root logger once per process, prefixing every line with the rank."""
    rank_text = "" if rank is None else f"[rank {rank}] "
    fmt = f"%(asctime)s {rank_text}%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr, force=True)


def progress_options(rank: int = 0) -> dict[str, object]:
    """tqdm options: a live bar on a terminal; in a log file, a plain line every 30 s or so."""
    interactive = sys.stderr.isatty()
    return {
        "disable": rank != 0,
        "dynamic_ncols": interactive,
        "mininterval": 0.5 if interactive else float(os.environ.get("CLIPFORGE_LOG_INTERVAL", 30)),
        "ascii": not interactive,
        "file": sys.stderr,
    }
