"""What a packing job is asked to do, and the checks the submitter makes before it waits in a queue."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from clipforge.base.errors import UserError
from clipforge.hpc.lock import WriterLock

from .corpus import probe_corpus
from .decode import ClipParams
from .store_format import Codec
from .store_writer import check_params


@dataclasses.dataclass(frozen=True)
class PackOptions:
    codec: Codec = "raw"
    """raw: uncompressed uint8 clips; jpeg: per-frame JPEG, ~10x smaller, decoded on read."""
    jpeg_quality: int = 90
    """JPEG quality for the jpeg codec."""
    max_shard_clips: int = 4096
    """Start a new shard after this many clips (a killed rank then loses at most one shard's work)."""
    overwrite: bool = False
    """Rebuild a store that was packed with other parameters."""
    append: bool = False
    """Add the corpus's new videos to an existing store as new shards, leaving the old ones alone."""


class PackError(UserError):
    """Packing cannot start as asked; the message names the input."""


def preflight(source: Path, out: Path, params: ClipParams, options: PackOptions) -> None:
    """What the submitter checks before a packing job waits in a queue: parameters, corpus, output directory.

    Seconds, not a corpus walk: a tree is read until its first video and a manifest's first
    paths are looked at. Each problem is one :class:`UserError` line.
    """
    params.check()
    if options.max_shard_clips < 1:
        raise PackError(f"--max-shard-clips is {options.max_shard_clips}; give a number of clips, at least 1")
    if not 1 <= options.jpeg_quality <= 100:
        raise PackError(f"--jpeg-quality is {options.jpeg_quality}; give a JPEG quality from 1 to 100")
    if options.codec != "jpeg" and options.jpeg_quality != PackOptions.jpeg_quality:
        raise PackError(
            f"--jpeg-quality {options.jpeg_quality} applies to --codec jpeg, and this store is {options.codec}; drop "
            "it or add --codec jpeg"
        )
    probe_corpus(source)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PackError(f"--out {out} is a file; give a directory for the clip store")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PackError(f"--out {out}: {existing} is not writable by you; choose a directory you can write")
    if out.is_dir():
        if not options.overwrite:
            check_params(out, store_params(params, options))
        WriterLock(out, "clip store").check_free()


def store_params(params: ClipParams, options: PackOptions) -> dict[str, Any]:
    """Everything that decides a store's bytes: a rerun with other values refuses to mix them in."""
    return {**dataclasses.asdict(params), "codec": options.codec, "jpeg_quality": options.jpeg_quality}
