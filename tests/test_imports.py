"""Published checkpoints in, proven by logits: transformers' VideoMAE and torchvision's video models, random weights.

Nobody here wrote the reference implementations: each test builds the model in
``transformers`` or torchvision, saves it the way its users download it, imports
the file with ``clipforge models import`` and compares clipforge's forward with
the original's on the same clips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency: setup.cfg's test extra installs it

from clipforge.models.builders import ModelError, create_model, load_trained, start_from
from clipforge.models.imports import import_checkpoint
from clipforge.rundir import RunDir

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FRAMES, SIZE = 4, 32


def small_config(**extra):
    """A VideoMAE at videovit-tiny's width (192, 3 heads, MLP 768), 2 layers, 4 frames of 32 px in 2x8x8 tubelets."""
    values = dict(
        image_size=SIZE,
        patch_size=8,
        num_frames=FRAMES,
        tubelet_size=2,
        hidden_size=192,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=768,
        num_labels=5,
        decoder_hidden_size=96,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=3,
        decoder_intermediate_size=384,
    )
    values.update(extra)
    return transformers.VideoMAEConfig(**values)


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight random (biases and norms too), so a mapping mistake cannot hide behind zeros and ones."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                scale = 1.0 if isinstance(module, torch.nn.LayerNorm) and name == "weight" else 0.0
                p.normal_(0.0, 0.05).add_(scale)
    return model.eval()


@pytest.fixture(scope="module")
def clips() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, FRAMES, SIZE, SIZE, 3), dtype=torch.uint8)


def pixel_values(clips: torch.Tensor) -> torch.Tensor:
    """What transformers' VideoMAE takes: ``[B, T, C, H, W]``, scaled to 0-1 and normalised by ImageNet's figures."""
    x = clips.permute(0, 1, 4, 2, 3).float() / 255
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 1, 3, 1, 1)


def imported_model(run: Path) -> torch.nn.Module:
    model, _ = load_trained(run)
    return model


def videomae_layout(hf_state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The same weights under the original VideoMAE repository's names (modeling_finetune.VisionTransformer)."""
    out = {
        "patch_embed.proj.weight": hf_state["videomae.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": hf_state["videomae.embeddings.patch_embeddings.projection.bias"],
        "fc_norm.weight": hf_state["fc_norm.weight"],
        "fc_norm.bias": hf_state["fc_norm.bias"],
        "head.weight": hf_state["classifier.weight"],
        "head.bias": hf_state["classifier.bias"],
    }
    for i in range(layers):
        hf, vm = f"videomae.encoder.layer.{i}.", f"blocks.{i}."
        a = hf + "attention.attention."
        out[vm + "attn.qkv.weight"] = torch.cat([hf_state[a + n + ".weight"] for n in ("query", "key", "value")])
        out[vm + "attn.q_bias"], out[vm + "attn.v_bias"] = hf_state[a + "query.bias"], hf_state[a + "value.bias"]
        pairs = [
            ("attn.proj", "attention.output.dense"),
            ("norm1", "layernorm_before"),
            ("norm2", "layernorm_after"),
            ("mlp.fc1", "intermediate.dense"),
            ("mlp.fc2", "output.dense"),
        ]
        for ours, theirs in pairs:
            for kind in ("weight", "bias"):
                out[f"{vm}{ours}.{kind}"] = hf_state[f"{hf}{theirs}.{kind}"]
    return out


def test_a_transformers_videomae_classifier_imports_with_its_logits(tmp_path: Path, clips) -> None:
    reference = randomise(transformers.VideoMAEForVideoClassification(small_config()))
    reference.config.id2label = {i: f"action {i}" for i in range(5)}
    reference.save_pretrained(tmp_path / "hf")
    import_checkpoint(tmp_path / "hf", "hf", tmp_path / "vmae")  # the command line: the refusal test below
    record = RunDir(tmp_path / "vmae").record()
    assert record.classes == [f"action {i}" for i in range(5)] and record.imported["from"] == "hf"
    ours = imported_model(tmp_path / "vmae")
    with torch.no_grad():
        expected = reference(pixel_values=pixel_values(clips)).logits
        got = ours(clips)
    assert (got - expected).abs().max().item() <= 1e-4, (got - expected).abs().max()
    assert expected.abs().max() > 0.1  # logits that say something: not a trivially small comparison


def test_the_original_videomae_layout_imports_with_the_same_logits(tmp_path: Path, clips) -> None:
    reference = randomise(transformers.VideoMAEForVideoClassification(small_config(layer_norm_eps=1e-6)))
    reference.fc_norm.eps = 1e-6  # VideoMAE's own code uses 1e-6 for every norm
    state = videomae_layout(reference.state_dict(), 2)
    import argparse

    torch.save({"model": state, "epoch": 3, "args": argparse.Namespace(model="vit_tiny")}, tmp_path / "checkpoint.pth")
    weights, imported = import_checkpoint(
        tmp_path / "checkpoint.pth", "videomae", tmp_path / "vm", frames=FRAMES, image_size=SIZE
    )
    assert imported.overrides["qkv_bias"] == "qv" and imported.overrides["head_norm"] == "pooled"
    ours = imported_model(tmp_path / "vm")
    with torch.no_grad():
        expected = reference(pixel_values=pixel_values(clips)).logits
        got = ours(clips)
    assert (got - expected).abs().max().item() <= 1e-4, (got - expected).abs().max()


def test_a_pretraining_checkpoint_imports_its_encoder_which_fine_tunes(tmp_path: Path, clips) -> None:
    pretrained = randomise(transformers.VideoMAEForPreTraining(small_config()))
    pretrained.save_pretrained(tmp_path / "pre")
    weights, imported = import_checkpoint(tmp_path / "pre", "hf", tmp_path / "enc")
    assert imported.encoder_only and imported.classes == [] and "decoder" in " ".join(imported.notes)
    with pytest.raises(ModelError, match="fine-tune"):
        load_trained(tmp_path / "enc")  # no classifier to evaluate
    # Fine-tuning builds the classifier for its own classes and starts the encoder from the import.
    overrides = {k: tuple(v) if k == "tubelet" else v for k, v in imported.overrides.items()}
    model = create_model("videovit-tiny", 7, FRAMES, SIZE, **overrides).eval()
    fresh = start_from(model, weights)
    assert fresh == ["3.norm.weight", "3.norm.bias", "3.fc.weight", "3.fc.bias"]
    with torch.no_grad():
        expected = pretrained.videomae(pixel_values(clips)).last_hidden_state
        got = model[:-1](clips)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name,frames,size", [("r2plus1d_18", 8, 32), ("mvit_v2_s", 16, 224)])
def test_torchvision_video_models_import_with_their_logits(tmp_path: Path, name: str, frames: int, size: int) -> None:
    import torchvision.models.video as tvv

    torch.manual_seed(2)
    reference = getattr(tvv, name)(weights=None, num_classes=6).eval()
    torch.save(reference.state_dict(), tmp_path / f"{name}.pth")
    import_checkpoint(
        tmp_path / f"{name}.pth", "torchvision", tmp_path / "tv", model=name, frames=frames, image_size=size
    )
    ours = imported_model(tmp_path / "tv")
    clip = torch.randint(0, 256, (1, frames, size, size, 3), dtype=torch.uint8)
    mean = torch.tensor((0.43216, 0.394666, 0.37645)).view(1, 3, 1, 1, 1)
    std = torch.tensor((0.22803, 0.22145, 0.216989)).view(1, 3, 1, 1, 1)
    with torch.no_grad():
        expected = reference((clip.permute(0, 4, 1, 2, 3).float() / 255 - mean) / std)
        got = ours(clip)
    assert (got - expected).abs().max().item() <= 1e-4, (got - expected).abs().max()


def test_keys_that_do_not_map_are_refused_in_one_line_naming_them(tmp_path: Path) -> None:
    reference = transformers.VideoMAEForVideoClassification(small_config())
    state = videomae_layout(reference.state_dict(), 2)
    state["blocks.0.attn.relative_position_bias_table"] = torch.zeros(3)
    torch.save({"module": state}, tmp_path / "odd.pth")
    argv = [sys.executable, "-m", "clipforge.jobs.cli", "models", "import", str(tmp_path / "odd.pth")]
    result = subprocess.run(
        [*argv, "--from", "videomae", "--name", "x", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "blocks.0.attn.relative_position_bias_table: no place for it" in result.stderr, result.stderr
    assert not (tmp_path / "x" / "final").exists()
    (tmp_path / "code.pth").write_bytes(b"\x80\x04cos\nsystem\n.")  # a pickle that would run code
    result = subprocess.run(
        [*argv[:-1], str(tmp_path / "code.pth"), "--from", "videomae", "--name", "y"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "not a checkpoint loadable without running code" in result.stderr
    assert json.dumps(result.stderr).count("\\n") <= 2  # one line
