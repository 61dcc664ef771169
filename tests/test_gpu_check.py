"""The prepared device check, run on CPUs at a small size: the same script a GPU node runs."""

from __future__ import annotations

import pytest


@pytest.fixture
def device_check(early):
    """The check's run (helpers.device_check), made while the rest of the suite ran."""
    return early.result("device-check")


def test_the_device_check_trains_resumes_evaluates_and_prints_its_table_on_cpus(device_check) -> None:
    result, table = device_check
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| zero-")]
    assert [row.split("|")[1].strip() for row in rows] == ["zero-0", "zero-3"]
    assert all("%" in row.split("|")[4] for row in rows)  # an MFU for every run
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 6 and all(v.startswith("PASS") for v in verdicts), verdicts
    assert any("killed after step 3 and resumed" in v for v in verdicts)
    assert any("jpeg decode of" in v and "mean |difference| 0.00 levels" in v for v in verdicts)  # CPUs: the same
    assert "| zero-3 |" in table.read_text()
