"""Configs and profiles: file < command line, and one clear line for mistakes."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize(
    "job, flags, says",
    [
        ("fl_train", ["--data.mixup", "0.8"], "--data.mixup 0.8: federated clients train on their own share"),
        ("fl_train", ["--data.class-balance", "loss"], "--data.class-balance loss: federated clients"),
        ("fl_train", ["--data.shuffle", "shards"], "--data.shuffle shards: federated clients"),
        ("fl_train", ["--gpus-per-node", "1"], "--gpus-per-node 1: federated training runs its server and clients on"),
        ("fl_train", ["--data.crop", "40"], "--data.crop 40 is larger than the store's 32x32 frames"),
        ("ps_train", ["--data.cutmix", "1.0"], "--data.cutmix 1.0: a parameter-server trainer reads its own share"),
        ("ps_train", ["--data.workers", "4"], "--data.workers 4: a parameter-server trainer"),
        ("ps_train", ["--gpus-per-node", "2"], "--gpus-per-node 2: the parameter server and its trainers run on CPUs"),
        ("ps_train", ["--model.weights", "registry:tiny@v1"], "does not fetch registry versions; fetch it with"),
        ("train", ["--elastic-min-nodes", "1", "--min-nodes", "2", "--nodes", "2"], "--min-nodes 2 with --elastic"),
    ],
)
def test_an_option_a_job_would_ignore_is_refused_in_one_line_before_it_starts(
    tiny_store: Path, job: str, flags: list[str], says: str
) -> None:
    """Options shared with training that the federated and parameter-server paths do not read (they were once
    accepted and silently ignored, as fl_train's --model.weights was)."""
    import importlib

    from clipforge.base.errors import UserError

    module = importlib.import_module(f"clipforge.jobs.{job}")
    argv = ["--data.store", str(tiny_store), "--model.name", "videovit-tiny", "--model.depth", "1", "--model.tubelet"]
    with pytest.raises(UserError, match=re.escape(says)):
        module.check(module.parse([*argv, "2", "8", "8", *flags]))


def test_a_parameter_server_job_takes_weights_for_other_classes_and_refuses_weights_that_do_not_fit(
    tiny_store: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    from clipforge.jobs import ps_train
    from clipforge.models.builders import ModelError, architecture

    tiny = ["--data.store", str(tiny_store), "--model.name", "videovit-tiny", "--model.tubelet", "2", "8", "8"]
    donor = architecture("videovit-tiny", 4, 8, 32, depth=1, tubelet=(2, 8, 8)).build(seed=3)  # 4 classes, not 6
    weights = tmp_path / "donor.safetensors"
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(weights))
    # Its classifier starts new, as in training (before, every rank refused it at its start, after the queue).
    ps_train.check(ps_train.parse([*tiny, "--model.depth", "1", "--model.weights", str(weights)]))
    with pytest.raises(ModelError, match="donor.safetensors does not fit the model"):
        ps_train.check(ps_train.parse([*tiny, "--model.depth", "2", "--model.weights", str(weights)]))
