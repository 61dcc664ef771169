"""Resources: validation before submission, the two renderings, and the job scripts' headers."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from clipforge.hpc.launch import job_spec
from clipforge.hpc.profile import load_profile
from clipforge.hpc.resources import ResourceError, Resources, parse_memory_mb, parse_time
from clipforge.jobs.commands.jobs import JOB_MODULES

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "text,minutes",
    [("30", 30), ("1:30", 2), ("02:00:00", 120), ("1-0", 1440), ("1-02:30", 1590), ("0-00:00:59", 1)],
)
def test_time_strings_slurm_accepts_are_parsed_to_minutes(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["1h", "", "1:2:3:4", "-5", "ten"])
def test_a_bad_time_string_names_the_field(text: str) -> None:
    with pytest.raises(ResourceError, match=r"^time: .* is not a Slurm time"):
        Resources(time=text).validate()


@pytest.mark.parametrize("field", ["nodes", "ntasks_per_node", "cpus_per_task"])
def test_counts_below_one_are_refused_with_the_field_name(field: str) -> None:
    with pytest.raises(ResourceError, match=rf"^{field}: must be at least 1"):
        Resources(**{field: 0}).validate()


def test_negative_gpus_are_refused() -> None:
    with pytest.raises(ResourceError, match=r"^gpus_per_node: must be 0 or more"):
        Resources(gpus_per_node=-1).validate()


def test_a_checkpoint_signal_due_before_the_job_starts_is_refused() -> None:
    # Due at the start, SIGUSR2 can come while the job still imports, before submitit's handler: it kills the job.
    with pytest.raises(ResourceError, match=r"^signal_delay_s: 120 s is not below the time limit \(2\): .* smaller"):
        Resources(time="2", signal_delay_s=120).validate()
    assert Resources(time="2", signal_delay_s=119).validate().signal_delay_s == 119


def test_memory_sizes() -> None:
    assert parse_memory_mb("64G") == 65536
    assert parse_memory_mb("500M") == 500
    assert parse_memory_mb("2048") == 2048
    with pytest.raises(ResourceError, match=r"^mem: "):
        Resources(mem="lots").validate()


def test_an_sbatch_flag_written_with_dashes_is_refused() -> None:
    with pytest.raises(ResourceError, match=r"^extra: .* without '--'"):
        Resources(extra=["--mail-type=END"]).validate()


def test_gpus_on_a_partition_without_gpus_are_refused_before_submission() -> None:
    profile = load_profile("dev")
    with pytest.raises(ResourceError, match=r"^gpus_per_node: partition 'debug' of 'dev' has 0 GPUs"):
        profile.apply(Resources(gpus_per_node=1))


def test_an_unknown_partition_lists_the_known_ones() -> None:
    with pytest.raises(ResourceError, match=r"choose one of batch, debug"):
        load_profile("dev").apply(Resources(partition="gpu"))


def test_time_over_the_partition_limit_is_refused() -> None:
    with pytest.raises(ResourceError, match=r"^time: 02:00:00 is over partition 'debug'"):
        load_profile("example-gpu").apply(Resources(partition="debug", gpus_per_node=1, time="02:00:00"))


def test_gpu_type_gives_the_gres_form() -> None:
    lines = Resources(gpus_per_node=4, gpu_type="a100").sbatch_lines()
    assert "#SBATCH --gres=gpu:a100:4" in lines
    assert not any("gpus-per-node" in line for line in lines)
    assert "#SBATCH --gpus-per-node=2" in Resources(gpus_per_node=2).sbatch_lines()


def test_profile_rendered_to_sbatch_lines_matches_the_golden_file() -> None:
    resources = Resources(
        nodes=8,
        ntasks_per_node=4,
        gpus_per_node=4,
        cpus_per_task=8,
        mem="200G",
        time="1-00:00:00",
        job_name="videovit-b",
        exclusive=True,
        qos="high",
        extra=["mail-type=END", "requeue"],
    )
    rendered = load_profile("example-gpu").apply(resources).sbatch_lines()
    golden = (GOLDEN / "example-gpu.sbatch").read_text().splitlines()
    assert rendered == golden, (
        "the #SBATCH lines changed; if that is intended, refresh the golden file with\n"
        "  clipforge jobs sbatch-lines --cluster example-gpu --nodes 8 --ntasks-per-node 4 --gpus-per-node 4 "
        "--cpus-per-task 8 --mem 200G --time 1-00:00:00 --job-name videovit-b --exclusive --qos high "
        "--extra mail-type=END requeue > tests/golden/example-gpu.sbatch"
    )


def test_submitit_parameters_are_accepted_by_submitits_own_sbatch_writer(tmp_path: Path) -> None:
    resources = load_profile("example-gpu").apply(
        Resources(nodes=2, ntasks_per_node=4, gpus_per_node=4, mem="64G", exclusive=True, extra=["mail-type=END"])
    )
    script = _make_sbatch_string(command="true", folder=tmp_path, **resources.submitit_parameters())
    ours = set(resources.sbatch_lines())
    theirs = set(script.splitlines())
    # Every line we render is a line submitit renders from the same Resources (submitit adds its log paths).
    assert ours <= theirs, ours - theirs


@pytest.mark.parametrize("name", sorted(JOB_MODULES))
def test_a_job_scripts_sbatch_header_is_its_declared_default_resources(name: str) -> None:
    """``sbatch jobs/X.py`` and ``python jobs/X.py`` must ask for the same resources."""
    spec = job_spec(JOB_MODULES[name])
    script = REPO / "jobs" / f"{name}.py"
    header = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert spec.module == f"clipforge.jobs.{name}"
    assert header == spec.default_resources().sbatch_lines(), (
        f"{script}'s #SBATCH lines and its declared default resources disagree; change the Resources default "
        f"in its Config, then paste the output of `clipforge jobs sbatch-lines --job {name}` as its header"
    )
