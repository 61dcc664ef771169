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
from clipforge.models.builders import architecture, count_flops, create_model, load_weights
from clipforge.models.evaluation import evaluate_model
from clipforge.models.settings import TrainSettings
from clipforge.models.trainer import Trainer
from clipforge.preprocess.reader import ClipDataset

from .helpers import LOCAL, RESHARDED, TINY, TINY_TRAINING, losses, train

# The ZeRO runs, the resume and the reshard read shards in random order, shuffled within windows of 16 clips
# (LOCAL); the other runs shuffle globally.


@pytest.fixture(scope="module")
def zero_runs(trained) -> dict[int, Path]:
    """A run of each ZeRO stage on 2 ranks, 12 steps (trained beside the suite: helpers.EARLY_TRAININGS)."""
    return {stage: trained[f"zero{stage}"] for stage in (0, 1, 2, 3)}


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
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-00000004" / "complete.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
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


def test_a_second_training_job_on_a_run_directory_is_refused_in_one_line(
    mpiexec, tiny_store: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    first = train(mpiexec, tiny_store, run, ranks=1, steps=5_000, wait=False)
    holder = None
    try:
        deadline = time.monotonic() + 300
        while not (run / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        holder = json.loads((run / LOCK_NAME).read_text())["pid"]  # the rank itself, not its launcher
        second = train(mpiexec, tiny_store, run, ranks=1, check=False)
    finally:
        if holder is not None:  # the launcher's death alone leaves a rank whose output goes nowhere running
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    errors = [line for line in second.stderr.splitlines() if "clipforge: error" in line]
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert len(errors) == 1 and "this run directory is being written by process" in errors[0], errors
    assert not (run / "final").exists()  # neither job finished: the refused one wrote nothing


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
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-00000008" / "complete.json").exists():
        assert time.monotonic() < deadline and not job.done(), Path(str(job.paths.stderr)).read_text()[-3000:]
        time.sleep(0.05)
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


RECIPES = Path(__file__).resolve().parents[1] / "jobs" / "configs"


def test_every_recipe_parses_and_the_train_recipes_pass_the_checks_but_for_their_store() -> None:
    from clipforge.jobs import preprocess as pack_job
    from clipforge.jobs import train as train_job

    packs = sorted(RECIPES.glob("*_pack.yaml"))
    trains = sorted(RECIPES.glob("*_train.yaml"))
    assert [p.name for p in packs] == ["k400_pack.yaml", "ucf101_pack.yaml"] and len(trains) == 2
    for recipe in packs:
        cfg = pack_job.parse(["--config", str(recipe)])
        assert cfg.clip.clip_frames == 16 and cfg.pack.codec == "jpeg"
        cfg.clip.check()
    k400 = train_job.parse(["--config", str(RECIPES / "k400_train.yaml")])
    assert (k400.model.name, k400.epochs, k400.optim.layer_decay, k400.optim.label_smoothing) == (
        "videovit-base",
        75,
        0.75,
        0.1,
    )
    assert (k400.data.mixup, k400.data.cutmix, k400.model.drop_path, k400.data.crop) == (0.8, 1.0, 0.1, 224)
    arch = architecture("videovit-base", 400, 16, 224, tubelet=(2, 16, 16), drop_path=0.1)
    assert arch.input.problem(16, 224, 224) is None  # the recipe's clips fit its model
    with pytest.raises(UserError, match="store/k400"):  # only the store is missing here
        train_job.check(k400)


def test_mixup_and_cutmix_give_soft_targets_weighted_by_what_was_mixed() -> None:
    from clipforge.models.clips import mix_batch

    clips = torch.stack([torch.full((2, 10, 10, 3), v, dtype=torch.uint8) for v in (0, 100, 200, 250)])
    labels = torch.tensor([0, 1, 2, 3])
    for mixup, cutmix in ((0.8, 0.0), (0.0, 1.0), (0.8, 1.0)):
        for seed in range(5):
            mixed, targets = mix_batch(clips, labels, 5, mixup, cutmix, torch.Generator().manual_seed(seed))
            again, same = mix_batch(clips, labels, 5, mixup, cutmix, torch.Generator().manual_seed(seed))
            assert torch.equal(mixed, again) and torch.equal(targets, same)  # a function of the seed: resume is exact
            assert torch.allclose(targets.sum(1), torch.ones(4)) and targets[:, 4].eq(0).all()
            # Each clip's mean value is its own times its weight plus its partner's (the batch reversed).
            own = targets[torch.arange(4), labels]
            expected = own * clips[:, 0, 0, 0, 0].float() + (1 - own) * clips.flip(0)[:, 0, 0, 0, 0].float()
            assert torch.allclose(mixed.mean(dim=(1, 2, 3, 4)), expected, atol=1e-3)


def test_layer_decay_gives_each_layer_its_rate_and_the_head_the_full_one() -> None:
    from clipforge.models.engine import parameter_groups

    model = create_model("videovit-tiny", 6, frames=8, image_size=32, depth=3, tubelet=(2, 8, 8))
    groups = parameter_groups(model, len(model), 1e-3, 0.75)
    assert [round(g["lr"] / 1e-3, 6) for g in groups] == [round(0.75**k, 6) for k in (4, 3, 2, 1, 0)]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert len(parameter_groups(model, len(model), 1e-3, 1.0)) == 1


def test_starting_weights_of_other_classes_keep_all_but_the_classifier(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from clipforge.models.builders import ModelError, start_from

    donor = create_model("videovit-tiny", 400, frames=8, image_size=32, depth=2, tubelet=(2, 8, 8))
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(tmp_path / "k400.safetensors"))
    model = create_model("videovit-tiny", 6, frames=8, image_size=32, depth=2, tubelet=(2, 8, 8))
    assert sorted(start_from(model, tmp_path / "k400.safetensors")) == ["3.fc.bias", "3.fc.weight"]
    assert torch.equal(model[1].attn.qkv.weight, donor[1].attn.qkv.weight) and model[3].fc.weight.shape[0] == 6
    wider = create_model("videovit-small", 6, frames=8, image_size=32, depth=2, tubelet=(2, 8, 8))
    with pytest.raises(
        ModelError, match=r"does not fit the model: 0\.\w+ is \(1, 64, 192\) there and \(1, 64, 384\) here"
    ):
        start_from(wider, tmp_path / "k400.safetensors")


def test_a_recipe_from_registry_weights_trains_for_an_epoch_on_a_tiny_store(
    mpiexec, zero_runs, tiny_store: Path, tmp_path: Path
) -> None:
    from clipforge.registry.repo import Ref, Registry

    registry = Registry.init(str(tmp_path / "registry.git"))
    version = registry.push(zero_runs[1], "tiny-start")
    registry.promote(version, "production")
    run = tmp_path / "recipe"
    # The UCF-101 recipe (mixup, CutMix, label smoothing, layer decay, drop path, epochs, bf16) on the tiny
    # model and store of these tests (TINY's flags win over the recipe's), from a registry version's weights.
    small = ["--config", str(RECIPES / "ucf101_train.yaml"), "--data.crop", "24", "--epochs", "1"]
    small += ["--optim.warmup-epochs", "0.25", "--data.workers", "0"]
    start = ["--model.weights", "registry:tiny-start@production", "--model.registry", registry.remote]
    # Killed after its first checkpoint, then started again with the same command, as a requeue does: it resumes
    # from the checkpoint (the registry weights were only where it started).
    first = train(mpiexec, tiny_store, run, *small, *start, "--checkpoint-every", "2", wait=False)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-00000002" / "complete.json").exists():
        assert first.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    result = train(mpiexec, tiny_store, run, *small, *start, "--checkpoint-every", "2")
    assert "resumed from checkpoint step-0000000" in result.stderr, result.stderr[-3000:]
    steps = -(-len(ClipDataset(tiny_store, "train")) // 8)  # one pass in global batches of 2 ranks x 4 clips
    assert f"1 epochs of the 'train' split: {steps} steps" in result.stderr, result.stderr[-3000:]
    started = (run / "start" / "model.safetensors").read_bytes()
    assert started == (zero_runs[1] / "final" / "model.safetensors").read_bytes()
    assert sorted(losses(run)) == list(range(1, steps + 1)) and all(np.isfinite(v) for v in losses(run).values())
    assert (run / "final" / "model.safetensors").exists() and (run / "eval.json").exists()
    # A version the registry does not have is refused before anything runs, in one line.
    from clipforge.jobs import train as train_job

    missing = ["--model.weights", "registry:tiny-start@v7", "--model.registry", registry.remote]
    cfg = train_job.parse(["--data.store", str(tiny_store), *TINY, *small, *missing])
    with pytest.raises(UserError, match="tiny-start@v7 does not exist; tiny-start has versions v1"):
        train_job.check(cfg)
    assert registry.resolve(Ref.parse("tiny-start@production")) == Ref("tiny-start", version=1)
    # Without model flags the version's architecture is the run's; a flag that contradicts it is refused.
    adopted = train_job.parse(["--data.store", str(tiny_store), *TINY_TRAINING, *start])
    train_job.check(adopted)
    assert (adopted.model.name, adopted.model.depth, adopted.model.tubelet) == ("videovit-tiny", 2, (2, 8, 8))
    deeper = train_job.parse(["--data.store", str(tiny_store), *TINY_TRAINING, *start, "--model.depth", "4"])
    with pytest.raises(UserError, match="--model.depth 4: the starting weights registry:tiny-start@production have 2"):
        train_job.check(deeper)


def test_epochs_and_warm_up_epochs_become_steps_before_anything_runs(tiny_store: Path) -> None:
    from clipforge.models.settings import resolve_settings

    s = TrainSettings(epochs=2.5, batch_per_rank=4, grad_accum=2)
    s.data.store, s.optim.warmup_epochs = tiny_store, 0.5
    resolve_settings(s, world_size=2)
    clips, global_batch = len(ClipDataset(tiny_store, "train")), 4 * 2 * 2
    assert s.steps == -(-5 * clips // (2 * global_batch))  # ceil(2.5 epochs x clips / global batch)
    assert s.optim.warmup_steps == round(0.5 * clips / global_batch)


def test_label_smoothing_reaches_the_loss_for_labels_and_for_mixed_targets() -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        class_weights=None, settings=SimpleNamespace(objective="classify", optim=SimpleNamespace(label_smoothing=0.1))
    )
    logits, labels = torch.randn(4, 6), torch.tensor([0, 3, 5, 1])
    log_p = torch.log_softmax(logits, dim=1)
    expected = (0.9 * -log_p[torch.arange(4), labels] + 0.1 * -log_p.mean(dim=1)).mean()
    assert torch.allclose(Trainer.loss(trainer, logits, labels), expected)
    mixed = 0.7 * torch.nn.functional.one_hot(labels, 6).float() + 0.3 * torch.nn.functional.one_hot(labels.flip(0), 6)
    soft = (0.9 * mixed + 0.1 / 6) * -log_p
    assert torch.allclose(Trainer.loss(trainer, logits, mixed), soft.sum(dim=1).mean())
