"""Configs and profiles: file < command line, and one clear line for mistakes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.hpc.profile import ProfileError, load_profile
from clipforge.jobs import config, selftest


def test_command_line_overrides_the_file_which_overrides_defaults(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("steps: 7\nstep_seconds: 0.5\nresources:\n  nodes: 3\n  time: '02:00:00'\n")
    cfg = selftest.parse(["--config", str(path), "--nodes", "4", "--state-dir", str(tmp_path)])
    assert (cfg.steps, cfg.step_seconds, cfg.resources.nodes, cfg.resources.time) == (7, 0.5, 4, "02:00:00")


def test_an_unknown_key_in_a_config_file_lists_the_allowed_ones(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("resources:\n  gpus: 4\n")
    with pytest.raises(config.ConfigError, match=r"resources: unknown setting\(s\) gpus; allowed: nodes, "):
        selftest.parse(["--config", str(path)])


def test_a_broken_yaml_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("steps: [1, 2\n")
    with pytest.raises(config.ConfigError, match=rf"config file {path} is not valid YAML"):
        selftest.parse(["--config", str(path)])


def test_a_config_path_that_is_a_directory_or_not_text_is_named(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=rf"config file {tmp_path} is a directory"):
        selftest.parse(["--config", str(tmp_path)])
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(config.ConfigError, match=rf"config file {binary} cannot be read"):
        selftest.parse(["--config", str(binary)])


def test_shipped_profiles_load() -> None:
    assert load_profile("local").executor == "local"
    dev = load_profile("dev")
    assert dev.executor == "slurm" and set(dev.partitions) == {"debug", "batch"}
    gpu = load_profile("example-gpu")
    assert gpu.setup_lines()[:2] == ["module load cuda/12.4", "module load openmpi/5.0"]


def test_a_missing_profile_lists_the_known_ones() -> None:
    with pytest.raises(
        ProfileError, match=r"cluster profile 'nowhere' not found; known profiles: .*dev.*example-gpu.*local"
    ):
        load_profile("nowhere")


def test_a_profile_with_an_unknown_setting_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("executor: slurm\nqueue: gpu\n")
    with pytest.raises(ProfileError, match=r"unknown setting\(s\) queue"):
        load_profile(str(path))


def test_a_user_mistake_on_the_command_line_is_one_line_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.jobs.selftest",
            "--time",
            "1h",
            "--executor",
            "debug",
            "--ntasks-per-node",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "clipforge: error: time: '1h' is not a Slurm time; use minutes ('30'), 'HH:MM:SS' or 'D-HH:MM:SS'"
    )
    assert "Traceback" not in result.stderr
