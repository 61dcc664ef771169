"""Processes on this host: whether one still runs (the lock's holder, a local job), and what runs below one."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, parents before children.

    From each process's parent in ``/proc/*/stat``, which every Linux has (``/proc/PID/task/*/children`` needs
    a kernel option).
    """
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree
