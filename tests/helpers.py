"""What several test modules share: command lines, the tiny training run, reading a run's metrics and a store.

Fixtures live in conftest.py; these are plain functions and constants, imported as ``from .helpers import ...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from clipforge.hpc.distenv import free_port
from clipforge.hpc.processes import process_tree
from clipforge.preprocess.store import ClipStore

if TYPE_CHECKING:
    from collections.abc import Callable

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


def sbatch_wait(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``sbatch --wait ARGV`` as a test needs it: the job's exit code as ``returncode``, sbatch's own output.

    ``sbatch --wait`` looks at the job 2 s after submitting it, then 8 s later, then every 32 s, so a job of 3 s
    took 10 s and one of 11 s took 42. This asks slurmctld every 0.2 s instead.
    """
    submitted = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True, env=env, check=True)
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=env).stdout
        fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
        if fields.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", None):
            break
        assert time.monotonic() < deadline, f"job {job} still {fields.get('JobState')} after {timeout:.0f} s"
        time.sleep(0.2)
    code, signal_number = (int(n) for n in fields["ExitCode"].split(":"))
    returncode = code or (128 + signal_number if signal_number else int(fields["JobState"] != "COMPLETED"))
    return subprocess.CompletedProcess(submitted.args, returncode, submitted.stdout, submitted.stderr)


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

# The parameter-server job's tiny model and trainers (its trainer flags are in the --trainer. group).
PS_TINY = [
    "--model.depth",
    "1",
    "--model.tubelet",
    "2",
    "8",
    "8",
    "--trainer.batch-per-rank",
    "4",
    "--trainer.log-every",
    "5",
    "--seed",
    "0",
]


def ps_argv(store: Path, run: Path, servers: int, trainers: int, *extra: str, model: list[str] = PS_TINY) -> list[str]:
    """One rank of the parameter-server job with ``servers`` servers and ``trainers`` trainers, PS_TINY's model."""
    argv = [sys.executable, "-m", "clipforge.jobs.ps_train", "--data.store", str(store), "--run-dir", str(run)]
    return [*argv, "--servers", str(servers), "--trainers", str(trainers), *model, *extra]


PS_SYNC_STEPS, PS_SYNC_LR = 4, 0.05
"""The synchronous run's steps and learning rate, which test_ps.py replays as data-parallel SGD."""
PS_EARLY: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "async": (
        1,
        2,
        ("--trainer.steps", "40", "--trainer.log-every", "1", "--server.optimizer", "adamw", "--server.lr", "0.001"),
    ),
    "two-servers": (2, 2, ("--trainer.steps", "6")),
    "sync": (1, 2, ("--server.mode", "sync", "--trainer.steps", str(PS_SYNC_STEPS), "--server.lr", str(PS_SYNC_LR))),
    "ssp": (
        1,
        2,
        (
            "--server.mode",
            "ssp",
            "--server.staleness",
            "1",
            "--trainer.steps",
            "16",
            "--trainer.slow-trainer",
            "1",
            "--trainer.slow-factor",
            "4",
        ),
    ),
}
"""The parameter-server runs of test_ps.py that are only read once finished: name -> (servers, trainers, flags)."""


def train_argv(mpiexec, store: Path, run_dir: Path, *extra: str, ranks: int = 2, steps: int = 12) -> list[str]:
    """The training job's command line on ``ranks`` CPU processes under mpiexec, with TINY's model; ``extra`` wins."""
    argv = [*mpiexec, "-n", str(ranks), "-x", f"MASTER_PORT={free_port()}", sys.executable, "-m"]
    argv += ["clipforge.jobs.train", "--data.store", str(store), "--run-dir", str(run_dir), "--steps", str(steps)]
    return [*argv, "--eval-every", "1000", "--checkpoint-every", "1000", *TINY, *extra]


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
    """The training job of :func:`train_argv`.

    Returns the completed process (asserted to succeed unless ``check`` is False), or the running one
    (in its own session, for os.killpg) when ``wait`` is False.
    """
    argv = train_argv(mpiexec, store, run_dir, *extra, ranks=ranks, steps=steps)
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def wait_for_checkpoint(run: Path, step: int, alive: Callable[[], bool], log: Callable[[], str] = str) -> None:
    """Until checkpoint ``step`` of ``run`` is complete: fails with ``log()`` if ``alive()`` turns False first, or
    after 300 s."""
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / f"step-{step:08d}" / "complete.json").exists():
        assert alive() and time.monotonic() < deadline, f"no checkpoint at step {step}: " + log()[-3000:]
        time.sleep(0.05)


def kill_after_checkpoint(proc: subprocess.Popen, run: Path, step: int) -> None:
    """SIGKILL ``proc`` (a :func:`train` started with ``wait=False``) and its session once checkpoint ``step`` of
    ``run`` is complete: a node lost mid-run."""
    wait_for_checkpoint(run, step, lambda: proc.poll() is None, lambda: "the run ended before it")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# -- a run's metrics and a store's clips --------------------------------------------------


def rows(run: Path, kind: str) -> list[dict]:
    """The records of one kind ("train", "checkpoint", "ps", ...) in a run's metrics.jsonl, in order."""
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of every step, the last record winning (a resumed run logs the steps after its checkpoint again)."""
    return {r["step"]: r["loss"] for r in rows(run_dir, "train")}


def tiny_start(seed: int = 0):
    """TINY's model on the tiny store (6 classes, 8x32x32 clips) as every tiny run starts it (seed 0)."""
    from clipforge.models.builders import architecture

    return architecture("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8)).build(seed=seed)


def training_clips_loss(store: Path, weights: Path) -> tuple[float, float]:
    """Cross-entropy of the tiny model on the store's training clips: at its seed-0 start, and with ``weights``.

    What a short run says about learning: its logged curve says less over a few steps (shards read in turn hold
    few classes, and a step's loss rises with a batch of classes not seen yet).
    """
    import torch
    import torch.nn.functional as F

    from clipforge.models.builders import load_weights
    from clipforge.preprocess.reader import ClipDataset

    dataset = ClipDataset(ClipStore.open(store), "train")
    clips = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(len(dataset))])
    labels = torch.as_tensor([int(dataset[i][1]) for i in range(len(dataset))])
    start, trained = tiny_start().eval(), tiny_start().eval()
    load_weights(trained, weights)
    with torch.no_grad():
        before, after = (F.cross_entropy(m(clips), labels).item() for m in (start, trained))
    return before, after


def clips_in_index_order(store: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Clips, labels and video paths, read in index order (by video, then clip)."""
    s = ClipStore.open(store)
    clips = np.stack([s.read_clip(int(p)) for p in s.order])
    return clips, s.labels[s.order], [s.videos["path"][v] for v in s.video_ids[s.order]]


def assert_same_store(a: Path, b: Path) -> None:
    """The same clips, labels and video paths, in index order, whatever ranks or shards wrote them."""
    left, right = clips_in_index_order(a), clips_in_index_order(b)
    assert np.array_equal(left[0], right[0]) and np.array_equal(left[1], right[1]) and left[2] == right[2]


LOCAL = ["--data.shuffle", "shards", "--data.shuffle-window", "16"]
"""Locality-aware sampling: shards in random order, clips shuffled within a window."""
_ZERO1 = ("--parallel.zero-stage", "1")
_PIPELINE = ("--parallel.pipeline-stages", "2", "--parallel.partition-method", "uniform", "--optim.clip-grad", "0.05")
EARLY_TRAININGS: dict[str, tuple[tuple[str, ...], int, int]] = {
    # test_evaluate.py's: bf16 ZeRO-2 on 24x24 crops of the 32x32 store, room for three spatial views. First: it
    # runs before test_recipes.py (zero1) and test_train.py (the rest).
    "cropped": (("--precision", "bf16", "--parallel.zero-stage", "2", "--data.crop", "24"), 2, 6),
    **{f"zero{stage}": (("--parallel.zero-stage", str(stage), *LOCAL), 2, 12) for stage in (1, 0, 2, 3)},
    "accum": (("--grad-accum", "2"), 2, 6),
    "double": (("--batch-per-rank", "8"), 2, 6),  # overrides TINY's batch of 4
    # With clipping on, and low enough to bite: the norm it clips by must be the whole model's across both stages,
    # or the pipeline's losses part from one process's after a few steps.
    "pipe": (_PIPELINE, 2, 8),
    "one": (("--optim.clip-grad", "0.05"), 1, 8),
    "grid": (("--parallel.pipeline-stages", "2", *_ZERO1), 4, 6),
    "flat": (_ZERO1, 2, 6),
}
"""The runs of test_train and test_evaluate that are only read once finished: name -> (flags beside TINY's, ranks,
steps)."""

MAE = ["--objective", "mae", "--mae.decoder-depth", "1", "--mae.no-norm-pixels", "--optim.lr", "2e-3"]
MAE += ["--optim.warmup-steps", "2", "--eval-every", "15", "--checkpoint-every", "10", "--data.workers", "0"]
"""test_pretrain.py's pretraining (on raw pixels: see its last test), evaluated twice and checkpointed at step 10."""
MAE_STEPS = 30
RESHARDED = (
    "--parallel.zero-stage",
    "2",
    "--checkpoint-every",
    "4",
    "--batch-per-rank",
    "2",
    "--elastic-min-nodes",
    "1",
    "--epochs",
    "1.25",
    *LOCAL,
)
"""The flags of test_train.py's run that 4 ranks start and 2 ranks resume: 1.25 epochs of the tiny store's 72 clips
in global batches of 8 are 12 steps (a restart on 2 ranks once counted them in batches of 4: 23)."""
LATE_TRAININGS: dict[str, tuple[tuple[str, ...], int, int]] = {
    # The uninterrupted pretraining that test_pretrain.py's requeued Slurm job must equal.
    "mae": (tuple(MAE), 2, MAE_STEPS),
    # The 4-rank start that test_train.py resumes on 2 ranks from its step 4.
    "four-ranks": ((*RESHARDED, "--keep-checkpoints", "3"), 4, 12),
}
"""Runs read by the last modules before those that check the early work (test_pretrain.py, test_train.py), trained
after :data:`EARLY_TRAININGS` and the parameter-server runs, beside the suite's last minutes, in which one test at
a time mostly leaves a core idle: same form."""


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, all found before the first is killed."""
    for each in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)
