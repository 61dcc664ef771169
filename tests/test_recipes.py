"""Training recipes and what they turn on: mixup and CutMix, label smoothing, layer decay, epochs, and starting
from another run's or a registry version's weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from clipforge.base.errors import UserError
from clipforge.models.builders import architecture, create_model
from clipforge.preprocess.reader import ClipDataset
from clipforge.train.settings import TrainSettings
from clipforge.train.trainer import Trainer

from .helpers import TINY, TINY_TRAINING, kill_after_checkpoint, losses, train

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
    from clipforge.train.engine import parameter_groups

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
    kill_after_checkpoint(first, run, 2)
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
    from clipforge.train.settings import resolve_settings

    s = TrainSettings(epochs=2.5, batch_per_rank=4, grad_accum=2)
    s.data.store, s.optim.warmup_epochs = tiny_store, 0.5
    resolve_settings(s, world_size=2)
    clips, global_batch = len(ClipDataset(tiny_store, "train")), 4 * 2 * 2
    assert s.steps == -(-5 * clips // (2 * global_batch))  # ceil(2.5 epochs x clips / global batch)
    assert s.optim.warmup_steps == round(0.5 * clips / global_batch)


def test_label_smoothing_reaches_the_loss_for_labels_and_for_mixed_targets() -> None:
    from types import SimpleNamespace

    from clipforge.train.objectives import Classify

    settings = SimpleNamespace(objective="classify", optim=SimpleNamespace(label_smoothing=0.1))
    trainer = SimpleNamespace(class_weights=None, settings=settings, objective=Classify())
    logits, labels = torch.randn(4, 6), torch.tensor([0, 3, 5, 1])
    log_p = torch.log_softmax(logits, dim=1)
    expected = (0.9 * -log_p[torch.arange(4), labels] + 0.1 * -log_p.mean(dim=1)).mean()
    assert torch.allclose(Trainer.loss(trainer, logits, labels), expected)
    mixed = 0.7 * torch.nn.functional.one_hot(labels, 6).float() + 0.3 * torch.nn.functional.one_hot(labels.flip(0), 6)
    soft = (0.9 * mixed + 0.1 / 6) * -log_p
    assert torch.allclose(Trainer.loss(trainer, logits, mixed), soft.sum(dim=1).mean())
