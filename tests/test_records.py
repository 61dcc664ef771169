"""Following jobs: the scheduler is asked at most once per poll interval."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from clipforge.hpc import records
from clipforge.hpc.launch import run_script

pytestmark = pytest.mark.waits


def test_states_are_served_from_the_cache_within_the_poll_interval(tmp_path: Path, slurm) -> None:
    (tmp_path / records._CACHE).write_text(json.dumps({"at": 1000.0, "states": {"1": "RUNNING"}}))
    assert records.slurm_states(["1"], tmp_path, now=1000.0 + records.POLL_INTERVAL_S - 1) == {"1": "RUNNING"}
    # Past the interval, sacct is asked again: job 1 of this cluster has long finished or never existed here.
    fresh = records.slurm_states(["1"], tmp_path, now=1000.0 + records.POLL_INTERVAL_S + 1)
    assert fresh.get("1") != "RUNNING"
    assert json.loads((tmp_path / records._CACHE).read_text())["at"] == 1000.0 + records.POLL_INTERVAL_S + 1


def test_the_local_executor_runs_the_same_job_with_two_ranks() -> None:
    results = run_script("clipforge.jobs.selftest", ["--executor", "local", "--ntasks-per-node", "2"])
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["source"] for r in results} == {"submitit-local"} and results[0]["all_reduce"] == 3.0
    listed = records.list_jobs()
    assert [(r.executor, r.state) for r in listed] == [("local", "COMPLETED")]


def test_a_local_job_whose_rendezvous_port_is_taken_says_so_and_stops_its_other_task() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()  # rank 0 cannot listen here; rank 1 connects, and would wait for its 120 s timeout
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "clipforge.jobs.selftest", "--executor", "local", "--ntasks-per-node", "2"]
        result = subprocess.run(
            argv, env={**os.environ, "MASTER_PORT": str(port)}, capture_output=True, text=True, timeout=100
        )
    assert result.returncode != 0
    assert f"cannot listen on port {port} for the rendezvous: another process has it" in result.stderr
    assert "task 0 failed; stopping its other tasks" in result.stderr and "Traceback" not in result.stderr


def test_a_job_given_an_earlier_jobs_id_gets_its_own_result_and_logs(slurm, jobs_dir: Path) -> None:
    import pickle
    import subprocess
    import time

    # The ids the next jobs will get: a cluster started afresh numbers its jobs from 1 again.
    sbatch = ["sbatch", "--parsable", "--output", "/dev/null", "--wrap", "true"]
    last = int(subprocess.run(sbatch, capture_output=True, text=True, check=True).stdout.split(";")[0])
    old = time.time() - 3600
    for job_id in range(last + 1, last + 6):  # an earlier job's finished files under each of them
        folder = jobs_dir / str(job_id)
        folder.mkdir(parents=True)
        (folder / f"{job_id}_0_result.pkl").write_bytes(pickle.dumps(("success", {"earlier": True})))
        (folder / f"{job_id}_0_log.err").write_text("an earlier job's log\n")
        for path in folder.iterdir():
            os.utime(path, (old, old))
    result = run_script("clipforge.jobs.selftest", ["--cluster", "dev", "--ntasks-per-node", "1", "--wait", "True"])
    assert result["world_size"] == 1 and result["source"] == "slurm", result  # its own, not the earlier one's
    folder = jobs_dir / result["job_id"]
    assert "an earlier job's log" not in (folder / f"{result['job_id']}_0_log.err").read_text()
    (aside,) = folder.glob("earlier-*")
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        [f"{result['job_id']}_0_log.err", f"{result['job_id']}_0_result.pkl"]
    )


def test_jobs_status_logs_and_cancel_from_the_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    job = run_script(
        "clipforge.jobs.selftest",
        [
            "--executor",
            "local",
            "--ntasks-per-node",
            "1",
            "--wait",
            "False",
            "--steps",
            "600",
            "--step-seconds",
            "0.1",
            "--state-dir",
            str(tmp_path / "state"),
        ],
    )
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "jobs"]
    deadline = time.monotonic() + 60
    while "step 10/600" not in subprocess.run([*cli, "logs", job.job_id], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "no progress in the job's log"
        time.sleep(0.5)
    status = json.loads(subprocess.run([*cli, "status", job.job_id], capture_output=True, text=True, check=True).stdout)
    assert status["state"] == "RUNNING" and status["job_id"] == job.job_id
    subprocess.run([*cli, "cancel", job.job_id], check=True, capture_output=True)
    deadline = time.monotonic() + 30
    while records.find_job(job.job_id).state == "RUNNING":
        assert time.monotonic() < deadline, "the job did not stop"
        time.sleep(0.5)
    unknown = subprocess.run([*cli, "status", "999999"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "no job 999999" in unknown.stderr


def test_a_jobs_outcome_is_read_from_its_result_pickles_once_and_one_job_is_found_in_its_own_folder(
    tmp_path: Path,
) -> None:
    import pickle

    for job_id, outcome in (("101", "success"), ("102", "error")):
        folder = tmp_path / job_id
        folder.mkdir()
        record = {"job_id": job_id, "name": "train", "executor": "local", "submitted_at": float(job_id)}
        (folder / "clipforge-job.json").write_text(json.dumps(record))
        (folder / f"{job_id}_0_result.pkl").write_bytes(pickle.dumps((outcome, list(range(100_000)))))
    assert [(r.job_id, r.state) for r in records.list_jobs(tmp_path)] == [("102", "FAILED"), ("101", "COMPLETED")]
    # Kept beside the pickles: the same pickle (size and time) is not read again, even when it no longer loads.
    pickled = tmp_path / "101" / "101_0_result.pkl"
    stat = pickled.stat()
    pickled.write_bytes(b"\0" * stat.st_size)
    os.utime(pickled, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert records.find_job("101", tmp_path).state == "COMPLETED"
    # A changed pickle is read again.
    pickled.write_bytes(pickle.dumps(("error", None)))
    assert records.find_job("101", tmp_path).state == "FAILED"
    # A folder not named by its job id is still found, by its record.
    (tmp_path / "102").rename(tmp_path / "renamed")
    assert records.find_job("102", tmp_path).folder == tmp_path / "renamed"
