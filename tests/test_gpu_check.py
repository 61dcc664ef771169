"""The prepared device check, run on CPUs at a small size: the same script a GPU node runs."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.checks_early, pytest.mark.slow]


def test_the_device_check_trains_resumes_evaluates_and_prints_its_table_on_cpus(early) -> None:
    # Run while the rest of the suite ran (early.device_check); conftest puts this test last.
    status, output, table = early.result("device-check")
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    rows = [line for line in lines if line.startswith("| zero-")]
    assert [row.split("|")[1].strip() for row in rows] == ["zero-0"]
    assert "%" in rows[0].split("|")[4]  # its MFU
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 5 and all(v.startswith("PASS") for v in verdicts), verdicts
    assert any("killed after step 3 and resumed" in v for v in verdicts)
    assert any("jpeg decode of" in v and "mean |difference| 0.00 levels" in v for v in verdicts)  # CPUs: the same
    assert "| zero-0 |" in table.read_text()
