"""The checkpoint index of a run: which checkpoints finished saving, which still verify, which is newest.

DeepSpeed writes a checkpoint as a folder of files, one or more per rank. Each
rank hashes its files as it writes them and, once they are synced to disk,
leaves a manifest of them (``.rank-NNNNN.json``). A folder counts only once
``complete.json`` is in it: written by rank 0 when every rank's manifest is
there, with the sha256 of every file. A checkpoint cut short by a crash, a full
disk or a node failure therefore never looks complete, and one changed on disk
afterwards fails verification and is passed over.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from clipforge.base.files import sha256, write_json

COMPLETE = "complete.json"
LATEST = "latest.json"
MANIFEST = ".rank-{rank:05d}.json"


class CheckpointIndex:
    """The ``checkpoints/`` folder of a run directory."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @staticmethod
    def tag(step: int) -> str:
        """The folder name of the checkpoint taken after ``step`` optimizer steps."""
        return f"step-{step:08d}"

    def path(self, tag: str) -> Path:
        return self.folder / tag

    def is_complete(self, tag: str) -> bool:
        return (self.folder / tag / COMPLETE).exists()

    def complete(self) -> list[str]:
        """Tags of checkpoints that finished saving, newest first."""
        if not self.folder.is_dir():
            return []
        return sorted((p.parent.name for p in self.folder.glob(f"step-*/{COMPLETE}")), reverse=True)

    def verify(self, tag: str) -> str | None:
        """Why a complete checkpoint cannot be used (a file missing or changed), or None."""
        folder = self.folder / tag
        try:
            record = json.loads((folder / COMPLETE).read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable completion record: {exc}"
        for name, entry in record["files"].items():
            path = folder / name
            if not path.exists():
                return f"{name} is missing"
            if sha256(path) != (entry["sha256"] if isinstance(entry, dict) else entry):
                return f"{name} does not match its checksum"
        return None

    def newest_usable(self, skipped: Callable[[str, str], None] | None = None) -> str | None:
        """The newest complete checkpoint that verifies; ``skipped(tag, why)`` hears of each one passed over."""
        for tag in self.complete():
            problem = self.verify(tag)
            if problem is None:
                return tag
            if skipped is not None:
                skipped(tag, problem)
        return None

    def write_manifest(self, tag: str, rank: int, files: dict[str, dict]) -> None:
        """Rank ``rank``'s files of ``tag`` (name: sha256 and bytes), once they are synced to disk."""
        write_json(self.folder / tag / MANIFEST.format(rank=rank), files)

    def manifests(self, tag: str) -> list[dict[str, dict]]:
        """The manifests the ranks have left in ``tag`` so far."""
        found = []
        for path in sorted((self.folder / tag).glob(MANIFEST.replace("{rank:05d}", "*"))):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # written atomically: a file that does not parse is another writer's temporary
        return found

    def mark_complete(self, tag: str, step: int, writers: dict | None = None, files: dict | None = None) -> None:
        """Record every file of ``tag`` with its checksum: from now on it can be resumed.

        Rank 0 calls this, after all ranks saved. ``files``: what the ranks' manifests say (hashed as
        written); a file of the folder they do not name is hashed here. ``writers`` says how the ranks
        that wrote it were arranged (world size, data-parallel ranks, global batch), for a restart on fewer.
        """
        folder = self.folder / tag
        known = dict(files or {})
        for p in sorted(folder.rglob("*")):
            name = str(p.relative_to(folder))
            if p.is_file() and name not in known and not p.name.startswith("."):
                known[name] = {"sha256": sha256(p), "bytes": p.stat().st_size}
        write_json(folder / COMPLETE, {"step": step, "files": known, "writers": writers})
        write_json(self.folder / LATEST, {"tag": tag})

    def step(self, tag: str) -> int:
        """The step a complete checkpoint was taken after."""
        return int(json.loads((self.folder / tag / COMPLETE).read_text())["step"])

    def writers(self, tag: str) -> dict | None:
        """How the ranks that wrote ``tag`` were arranged, as given to :meth:`mark_complete` (None if unknown)."""
        try:
            marker = json.loads((self.folder / tag / COMPLETE).read_text())
            return marker.get("writers")
        except (OSError, ValueError):
            return None

    def prune(self, keep: int) -> list[str]:
        """Delete all but the ``keep`` newest complete checkpoints; returns the deleted tags."""
        old = self.complete()[keep:]
        for tag in old:
            self.discard(tag)
        return old

    def discard(self, tag: str) -> None:
        """Remove a checkpoint folder, complete or not (never leave half a checkpoint to fill the disk)."""
        shutil.rmtree(self.folder / tag, ignore_errors=True)
