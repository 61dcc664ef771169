"""What several test modules share: command lines, the tiny training run, reading a run's metrics and a store.

Fixtures live in conftest.py; these are plain functions and constants, imported as ``from .helpers import ...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from clipforge.hpc.distenv import free_port
from clipforge.preprocess.store import ClipStore

if TYPE_CHECKING:
    from clipforge.hpc.devcluster import LocalCluster

VENV_BIN = str(Path(sys.executable).parent)

# -- command lines ------------------------------------------------------------------------


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


def multinode_env(cluster: LocalCluster) -> dict[str, str]:
    """The environment of a client of ``cluster``: its SLURM_CONF, and this virtual environment's python first."""
    return dict(os.environ, **cluster.env, PATH=f"{VENV_BIN}:{os.environ['PATH']}")


# -- the tiny training run ----------------------------------------------------------------

TINY_MODEL = ["--model.name", "videovit-tiny", "--model.depth", "2", "--model.tubelet", "2", "8", "8"]
"""The tiny test model's flags."""
TINY_TRAINING = [
    "--batch-per-rank",
    "4",
    "--data.workers",
    "0",
    "--log-every",
    "5",
    "--optim.lr",
    "1e-3",
    "--optim.warmup-steps",
    "2",
]
"""The tiny training run's flags without the model's (for starting weights that bring their own architecture)."""
TINY = [*TINY_MODEL, *TINY_TRAINING]

# The parameter-server job's tiny model and trainers (its own flags: --trainer.batch, not --batch-per-rank).
PS_TINY = [
    "--model.depth",
    "1",
    "--model.tubelet",
    "2",
    "8",
    "8",
    "--trainer.batch",
    "4",
    "--trainer.log-every",
    "5",
    "--seed",
    "0",
]


def train(
    mpiexec,
    store: Path,
    run_dir: Path,
    *extra: str,
    ranks: int = 2,
    steps: int = 12,
    check: bool = True,
    wait: bool = True,
):
    """The training job on ``ranks`` CPU processes under mpiexec, with TINY's model; ``extra`` flags win.

    Returns the completed process (asserted to succeed unless ``check`` is False), or the running one
    (in its own session, for os.killpg) when ``wait`` is False.
    """
    argv = [
        *mpiexec,
        "-n",
        str(ranks),
        "-x",
        f"MASTER_PORT={free_port()}",
        sys.executable,
        "-m",
        "clipforge.jobs.train",
        "--data.store",
        str(store),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--eval-every",
        "1000",
        "--checkpoint-every",
        "1000",
        *TINY,
        *extra,
    ]
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


# -- a run's metrics and a store's clips --------------------------------------------------


def rows(run: Path, kind: str) -> list[dict]:
    """The records of one kind ("train", "checkpoint", "ps", ...) in a run's metrics.jsonl, in order."""
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of every step, the last record winning (a resumed run logs the steps after its checkpoint again)."""
    return {r["step"]: r["loss"] for r in rows(run_dir, "train")}


def clips_in_index_order(store: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Clips, labels and video paths, read in index order (by video, then clip)."""
    s = ClipStore.open(store)
    clips = np.stack([s.read_clip(int(p)) for p in s.order])
    return clips, s.labels[s.order], [s.videos["path"][v] for v in s.video_ids[s.order]]


def assert_same_store(a: Path, b: Path) -> None:
    """The same clips, labels and video paths, in index order, whatever ranks or shards wrote them."""
    left, right = clips_in_index_order(a), clips_in_index_order(b)
    assert np.array_equal(left[0], right[0]) and np.array_equal(left[1], right[1]) and left[2] == right[2]
