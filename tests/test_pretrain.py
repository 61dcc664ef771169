"""Masked-autoencoder pretraining with real DeepSpeed ranks on the Slurm cluster, and fine-tuning from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clipforge.models.builders import create_model, start_from
from clipforge.rundir import RunDir
from clipforge.train.inputs import ModelSettings

from .helpers import MAE, MAE_STEPS, TINY, losses, train, wait_for_checkpoint

STEPS = MAE_STEPS


@pytest.fixture(scope="module")
def pretrained(slurm, tiny_store: Path, late_trained, tmp_path_factory) -> tuple[Path, Path, str]:
    """A pretraining job of 2 Slurm tasks requeued by Slurm after its first checkpoint, and the same pretraining
    uninterrupted (2 ranks under mpiexec, trained beside the suite: helpers.LATE_TRAININGS)."""
    from clipforge.hpc.launch import run_script

    run = tmp_path_factory.mktemp("mae") / "requeued"
    args = ["--cluster", "dev", "--ntasks-per-node", "2", "--data.store", str(tiny_store), "--steps", str(STEPS)]
    # Bitwise equal to the reference's losses because both sides' ranks take one thread each (their share of the
    # two cores: distenv.share_cores); a loss's last bits depend on how many threads summed it.
    job = run_script("clipforge.jobs.train", [*args, *TINY, *MAE, "--wait", "False", "--run-dir", str(run)])
    wait_for_checkpoint(run, 10, lambda: not job.done(), lambda: Path(str(job.paths.stderr)).read_text())
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)
    job.results()
    return late_trained["mae"], run, Path(str(job.paths.stderr)).read_text()


def test_pretraining_requeued_by_slurm_resumes_with_the_same_losses_and_the_loss_falls(pretrained) -> None:
    reference, run, log = pretrained
    assert "resumed from checkpoint step-000000" in log, log[-3000:]
    got, expected = losses(run), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == expected[s] for s in range(11, STEPS + 1)), (got, expected)  # the masks repeat too
    first, last = [expected[s] for s in range(1, 9)], [expected[s] for s in range(STEPS - 7, STEPS + 1)]
    assert sum(last) / len(last) < 0.95 * sum(first) / len(first), expected
    evaluated = [r["loss"] for r in RunDir(reference).metrics("eval")]
    assert len(evaluated) == 2 and evaluated[1] < evaluated[0]  # on the held-out clips too
    record = RunDir(run).record()
    assert record.pretraining["mask_ratio"] == 0.9 and record.encoder_only and "loss" in record.metrics
    # The run ends with the encoder alone, under the classifier's names: embedding 0., blocks 1. and 2.
    weights = load_file(str(run / "final" / "model.safetensors"))
    assert {k.split(".")[0] for k in weights} == {"0", "1", "2"}


def test_the_pretrained_encoder_fine_tunes_from_its_run_with_its_architecture(pretrained, tmp_path: Path) -> None:
    _, run, _ = pretrained
    model = ModelSettings(weights=run)
    model.adopt_start()
    assert model.name == "videovit-tiny" and model.depth == 2 and model.tubelet == (2, 8, 8)
    assert model.weights == run / "final" / "model.safetensors"
    classifier = create_model(model.name, 4, 8, 32, **model.overrides())
    assert start_from(classifier, model.weights) == ["3.norm.weight", "3.norm.bias", "3.fc.weight", "3.fc.bias"]
    encoder = load_file(str(model.weights))
    assert all(torch.equal(classifier.state_dict()[k], v) for k, v in encoder.items())
    asked = ModelSettings(name="videovit-small", weights=run)
    with pytest.raises(Exception, match="are a videovit-tiny; drop --model.name"):
        asked.adopt_start()


def test_the_pretrained_encoder_fine_tunes_through_the_registry(
    mpiexec, pretrained, tiny_store: Path, tmp_path: Path
) -> None:
    from clipforge.registry.repo import Registry

    _, run, _ = pretrained
    registry = Registry.init(str(tmp_path / "registry.git"))
    ref = registry.push(run, "tiny-mae")
    assert "pretrained as a masked autoencoder" in registry.card(ref)
    weights = ["--model.weights", f"registry:{ref.name}@v{ref.version}", "--model.registry", registry.remote]
    result = train(mpiexec, tiny_store, tmp_path / "fine", *weights, ranks=1, steps=4)
    assert "3.fc.weight" in result.stderr and "an encoder from pretraining" in result.stderr
    assert RunDir(tmp_path / "fine").record().metrics["video_top1"] >= 0.0


def test_pretraining_refuses_what_it_cannot_do_in_one_line(tiny_store: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "clipforge.jobs.train", "--data.store", str(tiny_store), "--run-dir", str(tmp_path)]
    argv += ["--objective", "mae", "--executor", "debug", "--ntasks-per-node", "1"]
    cases = {
        ("--model.name", "r2plus1d_18"): "pretrains a videovit-* encoder; r2plus1d_18 is not one",
        ("--mae.mask-ratio", "1.5"): "--mae.mask-ratio 1.5: give a share between 0 and 1",
        ("--model.attention", "divided"): "joint attention and mean pooling",
    }
    for extra, expected in cases.items():
        result = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if "clipforge: error" in line]
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert len(errors) == 1 and expected in errors[0], errors


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--data.class-balance", "loss"], "a loss weighted by class or smoothed labels acts on labels"),
        (["--optim.label-smoothing", "0.1"], "a loss weighted by class or smoothed labels acts on labels"),
        (["--parallel.activation-checkpointing"], "activation checkpointing would recompute all of it"),
    ],
)
def test_pretraining_refuses_label_settings_and_a_checkpointing_that_saves_nothing(
    tiny_store: Path, flags: list[str], says: str
) -> None:
    """Once accepted and ignored (the labels' settings), or worse than ignored (a second forward pass)."""
    from clipforge.jobs import train
    from clipforge.train.settings import TrainError

    cfg = train.parse(["--data.store", str(tiny_store), "--objective", "mae", *TINY, *flags])
    with pytest.raises(TrainError, match=re.escape(says)):
        train.check(cfg)


def test_the_targets_are_each_tubelets_pixels_normalised_by_its_own_mean_and_deviation_unless_asked_not_to() -> None:
    """VideoMAE's default loss (the Slurm runs above pretrain on raw pixels: see their flags)."""
    from clipforge.models.mae import MaeSettings, mae_architecture

    def autoencoder(norm_pixels: bool):
        arch = mae_architecture(
            "videovit-tiny", 4, 16, MaeSettings(norm_pixels=norm_pixels), depth=1, tubelet=(2, 8, 8)
        )
        ((make, args),) = arch.layers
        return make(*args)

    clips = torch.randint(0, 256, (2, 4, 16, 16, 3), dtype=torch.uint8)
    raw, normalised = autoencoder(False).targets(clips), autoencoder(True).targets(clips)
    assert raw.shape == normalised.shape == (2, 8, 2 * 8 * 8 * 3)  # 2 x 2 x 2 tubelets of 2x8x8 RGB pixels
    # Tubelet 1 of clip 1: frames 0-1, rows 0-7, columns 8-15, in (frame, row, column, channel) order.
    assert torch.equal(raw[1, 1].reshape(2, 8, 8, 3), clips[1, :2, :8, 8:].float() / 255)
    per_channel = normalised.reshape(2, 8, 2 * 8 * 8, 3)
    assert per_channel.mean(dim=2).abs().max() < 1e-5
    assert (per_channel.std(dim=2) - 1).abs().max() < 1e-4


def test_tube_masks_hide_the_same_patches_at_every_time_and_random_masks_a_share_of_all_the_tokens() -> None:
    from clipforge.models.mae import random_mask, tube_mask

    torch.manual_seed(0)
    grid, cpu = (4, 4, 4), torch.device("cpu")  # 4 time steps of 4 x 4 patches: 64 tokens, 16 a time step

    def visible_cells(visible: torch.Tensor) -> list[list[set[int]]]:
        """Per clip, the spatial cells visible at each time step."""
        return [[{i % 16 for i in row.tolist() if i // 16 == t} for t in range(4)] for row in visible]

    for draw, keep in ((tube_mask, 8), (random_mask, 6)):  # tube: 2 of 16 cells x 4 times; random: 6 of 64
        visible, masked = draw(32, grid, 0.9, cpu)
        assert visible.shape == (32, keep) and masked.shape == (32, 64 - keep)
        assert all(sorted(v + m) == list(range(64)) for v, m in zip(visible.tolist(), masked.tolist()))
    tubes = visible_cells(tube_mask(32, grid, 0.9, cpu)[0])
    assert all(len(clip[0]) == 2 and clip.count(clip[0]) == 4 for clip in tubes)
    scattered = visible_cells(random_mask(32, grid, 0.9, cpu)[0])
    assert sum(clip.count(clip[0]) < 4 for clip in scattered) > 16  # most clips see other cells at other times
