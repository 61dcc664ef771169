"""What a newcomer runs into first, run as they would run it: one line for each mistake, nothing noisy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from clipforge.hpc.executor import make_executor, submit
from clipforge.hpc.lock import WriterLock
from clipforge.hpc.profile import ProfileError, load_profile
from clipforge.hpc.resources import Resources
from clipforge.preprocess import synthetic

from .helpers import options, sbatch_wait

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


def user_runs(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def one_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one-video")
    synthetic.write_video(root / "up" / "a.mp4", synthetic.VideoSpec("move_up", frames=20, width=32, height=32))
    return root


def packing_mistakes(tmp: Path, corpus: Path, store: Path) -> dict[str, tuple[list[str], str]]:
    """Each mistake a new user makes with the packing job, and the words of its one line."""
    (tmp / "empty").mkdir()
    (tmp / "no-videos" / "cats").mkdir(parents=True)
    (tmp / "no-videos" / "cats" / "readme.txt").write_text("the videos are elsewhere")
    (tmp / "wrong-root.csv").write_text("path,label\n" + "".join(f"clips/{i}.mp4,a\n" for i in range(10)))
    (tmp / "bad.jsonl").write_text('{"path": "a.mp4", "label": "x"}\nnot json\n')
    (tmp / "a-file").write_text("")
    store_params = json.loads((store / "params.json").read_text())
    return {
        "missing": ([str(tmp / "no-such-dir")], "does not exist; give a corpus folder or a .csv/.jsonl manifest"),
        "empty": ([str(tmp / "empty")], "no videos in it (it has no class folders)"),
        "no videos": ([str(tmp / "no-videos")], "no videos in its 1 class folders"),
        "wrong root": ([str(tmp / "wrong-root.csv")], "none of its first 5 videos can be packed"),
        "bad manifest": ([str(tmp / "bad.jsonl")], "bad.jsonl:2: not a JSON object"),
        "height 0": ([str(corpus), "--height", "0"], "height: must be at least 1, got 0"),
        "jpeg quality of a raw store": ([str(corpus), "--jpeg-quality", "80"], "applies to --codec jpeg"),
        "out is a file": ([str(corpus), "--out", str(tmp / "a-file")], "is a file; give a directory"),
        "other store": (
            [str(corpus), "--out", str(store), "--height", str(store_params["height"] * 2)],
            "was packed with other parameters (",
        ),
        "store in use": ([str(corpus), "--out", str(tmp / "busy")], "this clip store is being written by process"),
    }


def test_packing_mistakes_are_one_line_before_anything_is_submitted(
    tmp_path: Path, jobs_dir: Path, one_video: Path, clean_store: Path
) -> None:
    busy = WriterLock(tmp_path / "busy", "clip store").acquire()  # another packing job, alive, on that store
    for name, (args, words) in packing_mistakes(tmp_path, one_video, clean_store).items():
        videos, *rest = args
        if "--out" not in rest:
            rest += ["--out", str(tmp_path / "store")]
        result = user_runs(sys.executable, str(REPO / "jobs" / "preprocess.py"), "--videos", videos, *rest)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, f"{name}: {result.stderr[-2000:]}"
        assert lines[0].startswith("clipforge: error: ") and words in lines[0], f"{name}: {lines[0]}"
        assert not jobs_dir.exists(), f"{name}: a job was submitted"
        assert not (tmp_path / "store").exists(), f"{name}: the store was started"
    busy.release()


def test_a_failed_job_prints_its_own_reason_then_where_its_log_is(tmp_path: Path, jobs_dir: Path, one_video) -> None:
    # A manifest whose first entries are fine but that lists a video twice: found by the job, not before it.
    manifest = one_video / "twice.csv"
    manifest.write_text("path,label\nup/a.mp4,up\nup/a.mp4,down\n")
    flags = options(videos=manifest, out=tmp_path / "store", executor="local", ntasks_per_node=2)
    result = user_runs(sys.executable, str(REPO / "jobs" / "preprocess.py"), *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"clipforge: error: job (\d+) failed: (.*); full log: (\S+)", last)
    assert found, result.stderr[-3000:]
    job, reason, log = found.groups()
    assert reason == "up/a.mp4: listed twice (labels 'up' and 'down'); keep one entry"
    assert Path(log).is_file() and Path(log).parent.parent == jobs_dir
    assert "Traceback" not in result.stderr  # the echo of the job's log stops where its traceback starts
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "jobs"]
    status = json.loads(user_runs(*cli, "status", job).stdout)
    assert status["state"] == "FAILED" and status["reason"] == reason and status["log"] == log
    logs = user_runs(*cli, "logs", job)
    assert logs.stderr.strip().splitlines()[-1] == f"clipforge: job {job} failed: {reason}"


def environment_without_clipforge() -> dict[str, str]:
    """A login shell's environment with no virtual environment active: the system's python3 comes first."""
    keep = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYENV_VERSION")}
    return keep | {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def test_a_job_file_run_by_a_python_without_clipforge_says_which_in_one_line(tmp_path: Path) -> None:
    assert shutil.which("python3", path=environment_without_clipforge()["PATH"]) == SYSTEM_PYTHON
    result = user_runs(str(REPO / "jobs" / "train.py"), "--steps", "3", env=environment_without_clipforge())
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"clipforge: error: {SYSTEM_PYTHON} cannot run this job (No module named")
    assert "activate the environment clipforge is installed in" in result.stderr


@pytest.mark.slurm
def test_sbatch_from_a_shell_without_the_environment_says_so_in_the_slurm_output(slurm, tmp_path: Path) -> None:
    env = environment_without_clipforge()
    result = sbatch_wait(f"--output={tmp_path / 'slurm-%j.out'}", str(REPO / "jobs" / "train.py"), env=env)
    assert result.returncode != 0
    log = next(tmp_path.glob("slurm-*.out")).read_text()
    assert log.startswith(f"clipforge: error: {SYSTEM_PYTHON} cannot run this job") and log.count("\n") == 1, log


def test_a_cluster_profile_names_the_environment_its_jobs_run_in(tmp_path: Path) -> None:
    # Another path to the same installed environment, as a shared venv or conda env would be on a cluster.
    environment = tmp_path / "shared-env"
    environment.symlink_to(Path(sys.prefix))
    profile = tmp_path / "mycluster.yaml"
    profile.write_text(f"executor: local\nenvironment: {environment}\n")
    executor = make_executor(Resources(time="5"), load_profile(str(profile)))
    job = submit(executor, sysconfig.get_path, "purelib", name="which-environment")
    assert Path(job.result()).is_relative_to(environment)  # the job's Python is the profile's, not this one
    profile.write_text(f"executor: local\nenvironment: {tmp_path / 'nowhere'}\n")
    with pytest.raises(ProfileError, match="has no bin/python; give the folder of the venv or conda env"):
        load_profile(str(profile))
