"""Training with real DeepSpeed on 2 (and 4) CPU processes with gloo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from clipforge.base.errors import UserError
from clipforge.hpc.lock import LOCK_NAME
from clipforge.inference.evaluation import evaluate_model
from clipforge.models.builders import architecture, count_flops, create_model, load_weights
from clipforge.preprocess.reader import ClipDataset
from clipforge.train.settings import TrainSettings
from clipforge.train.trainer import Trainer

from .helpers import LOCAL, RESHARDED, TINY_TRAINING, kill_after_checkpoint, losses, train, wait_for_checkpoint

# The ZeRO runs, the resume and the reshard read shards in random order, shuffled within windows of 16 clips
# (LOCAL); the other runs shuffle globally.


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_trains_and_writes_its_run(zero_runs, stage: int) -> None:
    # 12 steps are too few for the loss to fall reliably: the 40-step runs of test_multinode.py check that.
    curve = losses(zero_runs[stage])
    assert sorted(curve) == list(range(1, 13)) and all(np.isfinite(v) for v in curve.values())
    run = zero_runs[stage]
    assert (run / "final" / "model.safetensors").exists() and (run / "config.yaml").exists()
    assert (run / "plots" / "curves.png").exists() and (run / "plots" / "confusion.png").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_the_four_zero_stages_give_the_same_losses_at_fp32(zero_runs) -> None:
    reference = losses(zero_runs[0])
    for stage in (1, 2, 3):
        curve = losses(zero_runs[stage])
        assert all(abs(curve[s] - reference[s]) < 1e-3 for s in reference), (stage, curve, reference)


def test_a_zero3_runs_consolidated_weights_load_into_the_plain_model_and_evaluate_the_same(
    zero_runs, tiny_store: Path
) -> None:
    run = zero_runs[3]
    model = create_model("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8))
    load_weights(model, run / "final" / "model.safetensors")  # strict: raises on any missing or extra key
    metrics = evaluate_model(model, ClipDataset(tiny_store, "val"), batch=8, crop=None)
    recorded = json.loads((run / "eval.json").read_text())
    assert metrics["clip_top1"] == pytest.approx(recorded["clip_top1"]) and metrics["video_top1"] == pytest.approx(
        recorded["video_top1"]
    )


def test_gradient_accumulation_of_two_equals_a_doubled_batch(trained) -> None:
    a, b = losses(trained["accum"]), losses(trained["double"])  # 2 x 4 clips a rank, then 8 at once
    assert sorted(a) == list(range(1, 7)) and all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)


def test_a_pipeline_of_two_stages_trains_like_one_process(trained) -> None:
    # Both with gradient clipping at 0.05 (helpers.EARLY_TRAININGS): the pipeline must clip by the whole model's norm.
    pipe, one = losses(trained["pipe"]), losses(trained["one"])
    assert len(pipe) == 8 and all(abs(pipe[s] - one[s]) < 1e-4 for s in one), (pipe, one)  # same samples, same maths
    model = create_model("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8))
    load_weights(model, trained["pipe"] / "final" / "model.safetensors")


def test_two_pipeline_stages_times_two_data_parallel_on_four_processes_train_like_two_data_parallel_ranks(
    trained,
) -> None:
    # 4 ranks in 2 pipeline stages x 2 data-parallel, against 2 data-parallel ranks; ZeRO-1 both.
    grid, flat = losses(trained["grid"]), losses(trained["flat"])
    # Each data-parallel pair of stages reads what one of the two flat ranks reads: the same global batches.
    assert len(grid) == 6 and all(abs(grid[s] - flat[s]) < 1e-4 for s in flat), (grid, flat)
    assert json.loads((trained["grid"] / "final" / "run.json").read_text())["world_size"] == 4


def test_a_run_killed_after_a_checkpoint_resumes_with_the_same_losses(
    mpiexec, tiny_store: Path, tmp_path: Path, zero_runs
) -> None:
    run = tmp_path / "run"
    proc = train(mpiexec, tiny_store, run, "--parallel.zero-stage", "2", "--checkpoint-every", "4", *LOCAL, wait=False)
    kill_after_checkpoint(proc, run, 4)
    train(mpiexec, tiny_store, run, "--parallel.zero-stage", "2", "--checkpoint-every", "4", *LOCAL)
    resumed, reference = losses(run), losses(zero_runs[2])
    # Bitwise at fp32, with locality-aware sampling (the clips of a step are a function of seed and step).
    assert all(resumed[s] == reference[s] for s in range(5, 13)), (resumed, reference)
    # Each checkpoint written in the background has its record: the loop's wait, the write's time, its bytes,
    # which are the bytes of the files its complete.json lists with the checksums taken as they were written.
    from clipforge.rundir import CheckpointIndex

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = {r["step"]: r for r in rows if r["kind"] == "checkpoint"}
    assert {8, 12} <= set(saved) and all(r["blocked_s"] >= 0 and r["written_s"] > 0 for r in saved.values())
    index = CheckpointIndex(run / "checkpoints")
    complete = json.loads((index.path("step-00000012") / "complete.json").read_text())
    on_disk = sum((index.path("step-00000012") / name).stat().st_size for name in complete["files"])
    assert saved[12]["bytes"] == on_disk and index.verify("step-00000012") is None
    # On another number of ranks, without --elastic-min-nodes: one line, before any rank starts training.
    refused = train(mpiexec, tiny_store, run, "--parallel.zero-stage", "2", ranks=1, steps=14, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "written by 2 data-parallel ranks and this job has 1: run it on 2" in refused.stderr


def trained_steps(run: Path) -> list[int]:
    """The steps in a running training's metrics.jsonl so far (its last line may be half-written)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.startswith('{"kind": "train"') and line.endswith("}")]


def test_a_second_training_job_on_a_run_directory_is_refused_and_the_first_checkpoints_on_a_preemption_notice(
    mpiexec, tiny_store: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # Log windows of 1000 steps; after the first step, which times the steps, the ranks check for a notice every
    # 0.05 s of training instead (every step or two here), as they would every 10 s on steps slower than 0.1 s.
    notice = ["--log-every", "1000", "--preemption-poll-s", "0.05"]
    first = train(mpiexec, tiny_store, run, *notice, ranks=1, steps=5_000, wait=False)
    holder = None
    try:
        deadline = time.monotonic() + 300
        while not (run / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        holder = json.loads((run / LOCK_NAME).read_text())["pid"]  # the rank itself, not its launcher
        second = train(mpiexec, tiny_store, run, ranks=1, check=False)
        while not (steps := trained_steps(run)):  # the first window, then windows of a step or two
            assert first.poll() is None and time.monotonic() < deadline, "the first run stopped training"
            time.sleep(0.02)
        os.kill(holder, signal.SIGUSR2)  # what Slurm sends --signal-delay-s before a preemption or the time limit
        assert first.wait(timeout=300) != 0  # saved, then not requeued: no Slurm job to requeue
    finally:
        if holder is not None:  # the launcher's death alone leaves a rank whose output goes nowhere running
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    errors = [line for line in second.stderr.splitlines() if "clipforge: error" in line]
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert len(errors) == 1 and "this run directory is being written by process" in errors[0], errors
    assert not (run / "final").exists()  # neither job finished: the refused one wrote nothing
    # The notice came after step max(steps); the run saved a checkpoint a few steps later (the margin covers this
    # process being descheduled between reading the steps and the kill), not at the end of the log window (step
    # 1000) where it would otherwise have looked.
    saved = sorted(int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/complete.json"))
    assert len(saved) == 1 and max(steps) < saved[0] <= max(steps) + 20, (steps, saved)


def test_a_run_resumed_on_fewer_ranks_reshards_zero_and_keeps_the_global_batch(
    mpiexec, tiny_store: Path, tmp_path: Path, zero_runs, late_trained
) -> None:
    """4 ranks x 2 clips, resumed from step 4 on 2 ranks: 2 micro-batches of 2 each step, the same clips."""
    import shutil

    run = tmp_path / "run"  # a copy of the 4-rank run (helpers.LATE_TRAININGS), as if its job had died after step 4
    shutil.copytree(late_trained["four-ranks"], run, symlinks=True)
    for later in ("step-00000008", "step-00000012"):
        shutil.rmtree(run / "checkpoints" / later)
    result = train(mpiexec, tiny_store, run, *RESHARDED, ranks=2)
    assert "written by 4 data-parallel ranks, this job has 2: gradient accumulation 1 -> 2" in result.stderr
    assert "resumed from checkpoint step-00000004 at step 4, resharded" in result.stderr
    # The same clips each step (positions of the global batch): the 2-rank run of 4 clips per rank is the reference.
    resumed, reference = losses(run), losses(zero_runs[2])
    assert sorted(resumed) == list(range(1, 13))
    assert all(abs(resumed[s] - reference[s]) < 1e-4 for s in reference), (resumed, reference)
    assert not list((run / "checkpoints").glob("*universal*"))


def test_a_jpeg_store_decoded_on_the_device_trains_exactly_like_one_decoded_on_the_host(
    mpiexec, tmp_path: Path
) -> None:
    from clipforge.preprocess import synthetic

    store = synthetic.write_sharded_store(
        tmp_path / "jpeg", 6, clip_frames=8, size=32, codec="jpeg", videos_per_shard=4
    )
    args = ["--data.eval-split", "train", "--data.workers", "1"]
    # Both at once: each is one rank with one loader worker, and half of a lone run's time left a core idle.
    device = train(mpiexec, store, tmp_path / "device", *args, "--data.decode", "device", ranks=1, steps=4, wait=False)
    train(mpiexec, store, tmp_path / "host", *args, ranks=1, steps=4)
    assert device.wait(timeout=600) == 0
    host, device = losses(tmp_path / "host"), losses(tmp_path / "device")
    assert len(host) == 4 and host == device, (host, device)  # libjpeg-turbo either way on CPUs: the same pixels


def test_impossible_layouts_are_refused_before_launch_with_one_line(tiny_store: Path, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(
            key,
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}[key],
        )
    cases = [
        (
            dict(parallel=dict(pipeline_stages=2, zero_stage=2)),
            "zero_stage 2 cannot be combined with pipeline_stages 2",
        ),
        (dict(parallel=dict(pipeline_stages=3)), "pipeline_stages 3 does not divide the 2 ranks"),
        (dict(model=dict(name="mvit_v2_s")), "needs 16 frames per clip, the clips have 8"),
        (dict(model=dict(name="videovit-tiny", tubelet=(3, 8, 8))), "needs a multiple of 3 frames"),
        (dict(model=dict(name="r3d_18"), parallel=dict(pipeline_stages=2, zero_stage=0)), None),
        (dict(batch_per_rank=1000), "fewer than one global batch"),
        (dict(parallel=dict(offload_params=True, zero_stage=2)), "offload_params needs zero_stage 3"),
        (dict(data=dict(decode="device")), "data.decode=device needs a jpeg store"),
        (dict(data=dict(shuffle="shards", shuffle_window=0)), "data.shuffle_window is 0"),
    ]
    from clipforge.jobs.config import from_dict

    for overrides, message in cases:
        settings = from_dict(
            TrainSettings, {**overrides, "data": {"store": str(tiny_store), **overrides.get("data", {})}}
        )
        if message is None:
            Trainer(settings)  # r3d_18 is made of parts and may be split into stages
            continue
        with pytest.raises(UserError, match=message):
            Trainer(settings)


def test_a_bad_training_command_line_gives_one_line(tiny_store: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.jobs.train",
            "--executor",
            "debug",
            "--ntasks-per-node",
            "1",
            "--data.store",
            str(tiny_store),
            "--model.name",
            "videovit-colossal",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("clipforge: error: model 'videovit-colossal': size 'colossal' is not one of tiny")
    )


@pytest.mark.parametrize("attention,pool", [("joint", "mean"), ("joint", "cls"), ("divided", "mean")])
def test_the_transformer_flop_formula_matches_torchs_counter(attention: str, pool: str) -> None:
    arch = architecture("videovit-tiny", 6, 8, 64, depth=2, attention=attention, pool=pool)
    counted = count_flops(arch.build(), 8, 64)
    assert counted == pytest.approx(arch.flops(), rel=0.05)
    # The rest is exact: FlopCounterMode does not see the matmuls inside CPU scaled_dot_product_attention.
    t, h, w, d, depth = 4, 4, 4, 192, 2
    n = t * h * w + (1 if pool == "cls" else 0)
    hidden = 4 * d * (n * n if attention == "joint" else t * t * h * w + (h * w) ** 2 * t)
    assert counted + depth * hidden == arch.flops()


def test_every_named_model_states_its_input_and_builds() -> None:
    for name in ("r3d_18", "mc3_18", "r2plus1d_18"):
        model = create_model(name, 6, 8, 32)
        assert model(torch.zeros(1, 8, 32, 32, 3, dtype=torch.uint8)).shape == (1, 6)
    assert architecture("mvit_v2_s", 6).input.problem(16, 112, 112) == "needs 224x224 frames, the clips are 112x112"


@pytest.mark.slurm
def test_training_from_registry_weights_through_submitit_on_slurm_survives_scontrol_requeue(
    slurm, zero_runs, tiny_store: Path, tmp_path: Path
) -> None:
    from clipforge.hpc.launch import run_script
    from clipforge.registry.repo import Registry

    registry = Registry.init(str(tmp_path / "registry.git"))
    registry.push(zero_runs[1], "tiny-start")
    args = [
        "--model.weights",
        "registry:tiny-start@v1",
        "--model.registry",
        registry.remote,
        "--cluster",
        "dev",
        "--ntasks-per-node",
        "2",
        "--data.store",
        str(tiny_store),
        "--steps",
        "40",
        "--eval-every",
        "1000",
        "--parallel.zero-stage",
        "2",
        *TINY_TRAINING,  # no model flags: the version's record brings its architecture, on every rank
    ]
    # Both jobs at once (the node has room for both): their start-ups and Slurm's scheduling overlap.
    reference = run_script("clipforge.jobs.train", [*args, "--wait", "False", "--run-dir", str(tmp_path / "reference")])
    run = tmp_path / "requeued"
    job = run_script(
        "clipforge.jobs.train", [*args, "--wait", "False", "--run-dir", str(run), "--checkpoint-every", "4"]
    )
    wait_for_checkpoint(run, 8, lambda: not job.done(), lambda: Path(str(job.paths.stderr)).read_text())
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)  # 32 steps (a few seconds) before its end
    result = job.results()[0]
    reference.results()
    log = Path(str(job.paths.stderr)).read_text()
    assert "resumed from checkpoint step-000000" in log, log[-3000:]
    assert result["step"] == 40
    assert losses(run)[40] == losses(tmp_path / "reference")[40]


def test_evaluate_and_predict_take_a_finished_run(zero_runs, tiny_store: Path, tmp_path: Path) -> None:
    from clipforge.preprocess import synthetic

    run = zero_runs[1]
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.evaluate", "--run", str(run), "--split", "val"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    evaluated = json.loads((run / "eval-val.json").read_text())
    assert evaluated["video_top1"] == pytest.approx(json.loads((run / "eval.json").read_text())["video_top1"])
    video = synthetic.write_video(tmp_path / "clip.mp4", synthetic.VideoSpec("move_up", frames=40, width=64, height=48))
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.jobs.predict",
            str(video),
            str(tmp_path / "broken.mp4"),
            "--run",
            str(run),
            "--top",
            "2",
            "--out",
            str(tmp_path / "p.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]  # the others are classified, and the job says one failed
    assert (
        f"{tmp_path / 'broken.mp4'}: cannot classify: cannot open" in result.stderr and "Traceback" not in result.stderr
    )
    assert "failed: 1 of 2 videos could not be classified" in result.stderr.strip().splitlines()[-1]
    predictions = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [p["video"] for p in predictions] == [str(video), str(tmp_path / "broken.mp4")]
    assert len(predictions[0]["top"]) == 2 and "error" in predictions[1]
    assert sum(t["probability"] for t in predictions[0]["top"]) <= 1.0 + 1e-6
    # Prediction decodes its files: views from a store, once accepted and ignored, are refused in one line.
    from clipforge.jobs import predict

    with pytest.raises(UserError, match="--views.source store: prediction decodes the videos it is given"):
        predict.check(predict.parse([str(video), "--run", str(run), "--views.source", "store"]))
