"""Progress in a Slurm log file: whole lines, no carriage returns."""

from __future__ import annotations

import subprocess
import sys


def test_progress_off_a_terminal_is_plain_log_lines_without_carriage_returns(tmp_path) -> None:
    code = (
        "from clipforge.base.logs import Progress, setup_logging\n"
        "setup_logging(0)\n"
        "p = Progress(5, 'packing', unit='video', interval_s=0)\n"
        "for i in range(5): p.update(1, clips=4 * (i + 1))\n"
        "p.close()\n"
    )
    with open(tmp_path / "slurm.out", "w") as out:  # a file, as Slurm gives a batch job
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, check=True)
    text = (tmp_path / "slurm.out").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert any("packing: 3/5 video (60%)" in line and "clips=12" in line for line in lines)
    assert "packing: 5/5 video (100%)" in lines[-1] and "[rank 0]" in lines[-1]
