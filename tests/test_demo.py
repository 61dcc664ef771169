"""The main job end to end, each stage as a Slurm job on the local cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slurm
def test_the_demo_runs_every_stage_as_a_slurm_job_and_learns_the_motions(slurm, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.cli", "demo", "--cluster", "dev", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(ranks from slurm)" in result.stdout and "demo: OK" in result.stdout
    test = json.loads((tmp_path / "demo" / "run" / "eval-test.json").read_text())
    assert test["video_top1"] >= 0.75  # chance is 1 in 6
    assert (tmp_path / "demo" / "review.md").read_text().startswith("## Review: demo-videovit-tiny v1")
    errors = [
        json.loads(line)["path"] for line in (tmp_path / "demo" / "store" / "errors.jsonl").read_text().splitlines()
    ]
    assert len(errors) == 4 and all(p.startswith("move_right/") for p in errors)
    rerun = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.cli", "demo", "--cluster", "dev", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert rerun.returncode == 0 and "stage 3/5" in rerun.stderr
    assert "submitted clipforge.jobs.train" not in rerun.stderr  # finished stages are skipped
