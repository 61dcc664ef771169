"""Job scripts, submitit and requeue against the real single-node Slurm cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit

from clipforge.hpc import records
from clipforge.hpc.executor import make_executor, submit_array
from clipforge.hpc.launch import run_script
from clipforge.hpc.profile import load_profile
from clipforge.hpc.resources import Resources

from .helpers import options, sbatch_wait

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slurm, pytest.mark.waits]
SELFTEST = "clipforge.jobs.selftest"


def _wait_for_step(state: Path, at_least: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = json.loads(state.read_text())
            if data["step"] >= at_least:
                return data
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{state} never reached step {at_least}")


def _job_log(job: submitit.Job) -> str:
    return Path(str(job.paths.stdout)).read_text() + Path(str(job.paths.stderr)).read_text()


def test_a_submitit_job_with_two_tasks_sees_ranks_and_all_reduces(slurm) -> None:
    results = run_script(SELFTEST, ["--cluster", "dev", "--ntasks-per-node", "2", "--wait", "True"])
    assert sorted(r["rank"] for r in results) == [0, 1]
    # The test cluster binds no CPUs: each of the node's two tasks takes half its cores (one thread on two cores).
    shared = int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // 2))
    assert {r["threads"] for r in results} == {shared}
    for r in results:
        assert r["source"] == "slurm" and r["world_size"] == 2
        assert r["all_reduce"] == 3.0  # (0 + 1) + (1 + 1)
        assert r["environ"]["RANK"] == str(r["rank"]) and r["environ"]["WORLD_SIZE"] == "2"
    assert len({(r["master_addr"], r["master_port"]) for r in results}) == 1


def test_sbatch_of_a_job_script_relaunches_it_under_srun_with_the_jobs_tasks(slurm, tmp_path: Path) -> None:
    out = tmp_path / "slurm-%j.out"
    state = options(steps=2, step_seconds=0.2, state_dir=tmp_path / "state")
    result = sbatch_wait("--ntasks=2", f"--output={out}", str(REPO / "jobs" / "selftest.py"), *state)
    assert result.returncode == 0, result.stderr
    log = next(tmp_path.glob("slurm-*.out")).read_text()
    assert "re-launching under srun with 2 tasks" in log
    assert "rank 0 of 2" in log and "rank 1 of 2" in log and "(source slurm)" in log
    assert json.loads((tmp_path / "state" / "state.json").read_text())["step"] == 2


def test_a_job_array_is_one_sbatch_with_one_task_per_argument(slurm) -> None:
    executor = make_executor(Resources(time="5"), load_profile("dev"))
    jobs = submit_array(executor, os.getenv, ["SLURM_ARRAY_TASK_ID"] * 4, name="array-test")
    assert len({job.job_id.split("_")[0] for job in jobs}) == 1  # one array, one submission
    assert sorted(job.result() for job in jobs) == ["0", "1", "2", "3"]


def test_scontrol_requeue_resumes_a_running_job_from_its_saved_state(slurm, tmp_path: Path) -> None:
    state = tmp_path / "state"
    flags = options(cluster="dev", ntasks_per_node=2, wait=False, steps=30, step_seconds=0.5, state_dir=state)
    job = run_script(SELFTEST, flags)
    before = _wait_for_step(state / "state.json", 4)
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["restart_count"] == 1, _job_log(job)
        assert r["start_step"] >= before["step"]
        assert r["final_step"] == 30


def test_a_job_script_inside_salloc_runs_in_the_foreground(slurm) -> None:
    result = subprocess.run(
        ["salloc", "-n", "2", sys.executable, str(REPO / "jobs" / "selftest.py")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2" in result.stderr and "rank 1 of 2" in result.stderr


def test_jobs_list_shows_submitted_jobs_with_their_scheduler_state(slurm) -> None:
    results = run_script(SELFTEST, ["--cluster", "dev", "--ntasks-per-node", "1", "--wait", "True"])
    listed = records.list_jobs()
    assert len(listed) == 1 and listed[0].name == "selftest" and listed[0].executor == "slurm"
    assert listed[0].state == "COMPLETED"
    assert results["rank"] == 0


def test_a_job_at_its_time_limit_checkpoints_requeues_and_gives_up_after_the_bound(time_limited) -> None:
    job, state = time_limited
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="checkpoint function returned None"):
        job.results()
    log = _job_log(job)
    assert "requeuing (restart 1 of at most 1)" in log
    assert "not requeuing: the job has been requeued 1 times (bound 1)" in log
    final = json.loads((state / "state.json").read_text())
    assert final["restart_count"] == 1 and final["step"] > 0


def test_sbatch_of_a_parameter_server_job_whose_trainers_do_not_fill_the_allocation_is_refused_in_one_line(
    slurm, tiny_store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ps.out"
    # The script's header asks for 3 tasks: 1 server and 2 trainers. Inside the job every task after the servers
    # trains, so --trainers 4 was once ignored (the job ran 2).
    where = options(data__store=tiny_store, run_dir=tmp_path / "run", trainers=4)
    result = sbatch_wait(f"--output={out}", str(REPO / "jobs" / "ps_train.py"), *where)
    assert result.returncode != 0
    log = out.read_text()
    assert "--servers 1 --trainers 4 make 5 tasks, and this allocation has 3: give --trainers 2" in log, log[-3000:]
    assert "Traceback" not in log and not (tmp_path / "run").exists()
