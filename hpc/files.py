"""Files on a shared filesystem: written atomically, identified by checksum.

A reader on another node must never see half a file: every record is written
to a temporary name beside its target and renamed over it (``rename`` is
atomic on POSIX filesystems, Lustre included).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed over it when the block succeeds (removed when it fails)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: Path, data: Any, sort_keys: bool = False) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (paths and other objects as strings)."""
    return write_text(path, json.dumps(data, indent=1, sort_keys=sort_keys, default=str) + "\n")


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
