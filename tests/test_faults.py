"""Faults injected for real: a disk that fills up, a corrupted checkpoint, random command lines.

Each test says what it injects and checks that nothing is lost.
"""

from __future__ import annotations

import shutil
import string
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import losses
from .helpers import train as run_training

pytestmark = pytest.mark.faults


def train(mpiexec, store: Path, run: Path, *extra: str, steps: int = 12) -> subprocess.CompletedProcess:
    """test_train's run, checkpointing every 4 steps with three kept, ZeRO 1; a failure is returned, not asserted."""
    flags = ["--checkpoint-every", "4", "--keep-checkpoints", "3", "--parallel.zero-stage", "1"]
    return run_training(mpiexec, store, run, *flags, *extra, steps=steps, check=False)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 24 MiB tmpfs: room for one 15 MiB checkpoint of the tiny model, not two."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_checkpoint_that_fills_the_disk_leaves_the_previous_one_valid(
    mpiexec, tiny_store: Path, tmp_path: Path, small_disk: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(small_disk)
    failed = train(mpiexec, tiny_store, run)
    assert failed.returncode != 0
    line = next(line for line in failed.stderr.splitlines() if "could not be written" in line)
    # PyTorch's writer reports a full disk as "No space left on device" or as a short write ("unexpected pos").
    assert (
        "No space left" in line or "unexpected pos" in line
    ) and "the last complete checkpoint step-00000004 is intact" in line
    from clipforge.rundir import CheckpointIndex

    index = CheckpointIndex(small_disk)
    assert index.complete() == ["step-00000004"] and index.verify("step-00000004") is None
    # Free space (move the run to a larger disk) and start again: it resumes from step 4 and finishes.
    (run / "checkpoints").unlink()
    shutil.copytree(small_disk, run / "checkpoints")
    done = train(mpiexec, tiny_store, run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from checkpoint step-00000004 at step 4" in done.stderr
    assert max(losses(run)) == 12


def test_a_corrupted_latest_checkpoint_is_detected_and_the_one_before_is_used(
    mpiexec, tiny_store: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    first = train(mpiexec, tiny_store, run, steps=16)
    assert first.returncode == 0, first.stderr[-3000:]
    before = losses(run)
    latest = run / "checkpoints" / "step-00000016"
    victim = max((p for p in latest.rglob("*.pt")), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = train(mpiexec, tiny_store, run, steps=16)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint step-00000016 is unusable" in again.stderr and "does not match its checksum" in again.stderr
    assert "resumed from checkpoint step-00000012 at step 12" in again.stderr
    after = losses(run)
    assert all(after[s] == before[s] for s in range(13, 17))  # the redone steps are the same steps: nothing lost


ARG = st.text(alphabet=string.ascii_letters + string.digits + "-_./=:@ ", max_size=12)
FLAGS = st.sampled_from(
    [
        "--steps",
        "--batch-per-rank",
        "--precision",
        "--parallel.zero-stage",
        "--parallel.pipeline-stages",
        "--model.name",
        "--data.store",
        "--time",
        "--nodes",
        "--ntasks-per-node",
        "--gpus-per-node",
        "--mem",
        "--partition",
        "--config",
        "--optim.lr",
        "--data.crop",
        "--executor",
        "--cluster",
        "--extra",
    ]
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(st.one_of(FLAGS, ARG), max_size=6))
def test_random_command_lines_get_one_line_or_run_never_a_traceback(argv: list[str], tiny_store: Path) -> None:
    """Whatever is typed, the job refuses in one line (or argparse's usage) before submitting anything."""
    from clipforge.base.errors import UserError
    from clipforge.jobs import train as train_job

    try:
        cfg = train_job.parse(["--executor", "debug", "--ntasks-per-node", "1", "--data.store", str(tiny_store), *argv])
        train_job.check(cfg)
        from clipforge.hpc.profile import load_profile

        load_profile(cfg.launch.cluster).apply(cfg.resources)
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc)
    except SystemExit as exc:  # tyro's usage message for flags it cannot parse, exit code 2
        assert exc.code == 2
