"""Lustre: set a directory's striping before the first byte is written.

Striping applies to files created after it is set, so it must come first.
File-per-process output (one HDF5 shard per rank) wants a stripe count of 1;
a few large shared files want several OSTs (NERSC's guidance).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)


def stripe_directory(path: Path, count: int = 1, size: str = "4M") -> bool:
    """Create ``path`` and stripe it with ``lfs setstripe`` when Lustre's client is here.

    Returns whether striping was set; elsewhere (no ``lfs``, or not on Lustre) it is a no-op.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lfs = shutil.which("lfs")
    if lfs is None:
        log.debug("no lfs command: %s left with the filesystem's default layout", path)
        return False
    result = subprocess.run([lfs, "setstripe", "-c", str(count), "-S", size, str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        log.info("lfs setstripe on %s did not apply (%s); keeping the default layout", path, result.stderr.strip())
        return False
    log.info("striped %s over %d OST(s) with %s stripes", path, count, size)
    return True
