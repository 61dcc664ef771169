"""The prepared device check, run on CPUs at a small size: the same script a GPU node runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_trains_resumes_evaluates_and_prints_its_table_on_cpus(tmp_path: Path) -> None:
    small = ["--model", "videovit-tiny", "--depth", "2", "--tubelet", "2", "8", "8", "--frames", "8", "--size", "32"]
    small += ["--crop", "24", "--steps", "6", "--batch", "2", "--workers", "0", "--work", str(tmp_path / "work")]
    # One stage: the ZeRO stages themselves are tested in test_train.py; stage 2 runs in the kill-and-resume check.
    small += ["--stages", "0"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "gpu_check.py"), *small, "--out", str(tmp_path / "check.md")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| zero-")]
    assert [row.split("|")[1].strip() for row in rows] == ["zero-0"]
    assert "%" in rows[0].split("|")[4]  # its MFU
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 5 and all(v.startswith("PASS") for v in verdicts), verdicts
    assert any("killed after step 3 and resumed" in v for v in verdicts)
    assert any("jpeg decode of" in v and "mean |difference| 0.00 levels" in v for v in verdicts)  # CPUs: the same
    assert "| zero-0 |" in (tmp_path / "check.md").read_text()
