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
import shutil
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


CHUNK = 1 << 23
"""How much of a file one hashing read takes (8 MiB: past it, larger reads measured no faster)."""


def update_sha256(digest: hashlib._Hash, path: Path) -> None:
    """Feed the bytes of ``path`` into ``digest``, one :data:`CHUNK` at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)


def sha256(path: Path, copy_to: Path | None = None) -> str:
    """Hex sha256 of a file; with ``copy_to``, the file is then copied there (in the kernel, not through Python).

    Hashing first and copying second reads the file twice, but the second read comes from the page cache
    and ``copyfile`` uses ``copy_file_range``: measured faster than writing each hashed chunk from Python.
    """
    digest = hashlib.sha256()
    update_sha256(digest, path)
    if copy_to is not None:
        shutil.copyfile(path, copy_to)
    return digest.hexdigest()
