"""Starting and watching the daemons of a development cluster: Debian packages, pid files, readiness."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from clipforge.base.errors import UserError
from clipforge.hpc.processes import process_alive

from .shape import ClusterShape

log = logging.getLogger(__name__)


class ClusterError(UserError):
    """The local cluster could not be brought up; the message says what to look at."""


def running_pid(shape: ClusterShape, daemon: str) -> int | None:
    """The pid recorded for ``daemon``, if that process still runs."""
    try:
        pid = int(shape.pid_file(daemon).read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None
    return pid if process_alive(pid) else None


def wait_for(ready: Callable[[], bool], what: str, log_file: Path, timeout: float) -> None:
    """Poll ``ready`` every half second; after ``timeout`` s, fail naming ``what`` and its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise ClusterError(f"{what} did not come up within {timeout:.0f} s; see {log_file}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def install_packages(packages: list[str]) -> None:
    """apt-get install the Debian packages whose files are missing (needs root)."""
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"missing Debian packages {' '.join(missing)}: install them as root and retry")
    log.info("installing %s", " ".join(missing))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, check=True, capture_output=True)
