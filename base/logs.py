"""Logging that reads well in a Slurm output file.

One line per record, a timestamp, the rank, no colours and no carriage
returns when the output is not a terminal: :class:`Progress` is a tqdm bar on
a terminal and a plain log line every 30 s in a log file.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

ERROR_PREFIX = "clipforge: error: "
"""How every command and job prints a user's mistake: one line, this prefix, what to change."""
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt)): (.+)$")


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Configure the root logger once per process, prefixing every line with the rank."""
    rank_text = "" if rank is None else f"[rank {rank}] "
    fmt = f"%(asctime)s {rank_text}%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr, force=True)


class Progress:
    """Progress of one loop on rank 0: ``update(n, **figures)``; ``close()`` prints the last state.

    tqdm redraws with carriage returns, which turn a Slurm output file into one
    endless line; off a terminal we log a line per interval instead.
    """

    def __init__(
        self, total: int, desc: str, unit: str = "it", enabled: bool = True, interval_s: float | None = None
    ) -> None:
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.interactive = sys.stderr.isatty()
        self.interval = interval_s if interval_s is not None else float(os.environ.get("CLIPFORGE_LOG_INTERVAL", 30))
        self.n, self.figures, self.logged = 0, {}, -1
        self.started = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True) if enabled and self.interactive else None
        self.log = logging.getLogger("clipforge.progress")

    def update(self, n: int = 1, **figures: Any) -> None:
        if not self.enabled:
            return
        self.n += n
        self.figures.update(figures)
        if self.bar is not None:
            self.bar.update(n)
            if figures:
                self.bar.set_postfix(self.figures, refresh=False)
        elif time.monotonic() - self.last >= self.interval:
            self._log_line()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        elif self.logged != self.n:
            self._log_line()

    def _log_line(self) -> None:
        self.last = now = time.monotonic()
        self.logged = self.n
        rate = self.n / max(now - self.started, 1e-9)
        eta = (self.total - self.n) / rate if rate > 0 and self.total else 0.0
        extra = "".join(f", {k}={v}" for k, v in self.figures.items())
        percent = 100 * self.n / self.total if self.total else 100.0
        self.log.info(
            "%s: %d/%d %s (%.0f%%), %.1f %s/s, ETA %.0f s%s",
            self.desc,
            self.n,
            self.total,
            self.unit,
            percent,
            rate,
            self.unit,
            eta,
            extra,
        )


def failure_reason(logs: Iterable[Path]) -> str | None:
    """The one line a failed job gave as its reason, read from its logs (tasks in order).

    The last ``clipforge: error:`` line when there is one (a user's mistake, said by the job);
    otherwise the last line of the last traceback (a bug or a crash), as ``ExceptionName: message``.
    """
    said: str | None = None
    crashed: str | None = None
    for path in logs:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            at = line.find(ERROR_PREFIX)
            if at >= 0:
                said = line[at + len(ERROR_PREFIX) :].strip()
                continue
            match = _EXCEPTION_LINE.match(line)
            if match and match.group(1) not in ("FailedJobError", "UncompletedJobError"):
                crashed = f"{match.group(1)}: {match.group(2)}"
    return said or crashed
