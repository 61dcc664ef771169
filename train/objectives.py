"""What a run optimises, how it is evaluated, and what it ends with: the training objective.

The loop (:mod:`.trainer`) and the settings (:mod:`.settings`) ask the run's
:class:`Objective` and never which one it is. Two exist:

- :class:`Classify` (``--objective classify``): cross-entropy on the labels
  (class weights, label smoothing, soft targets of mixup and CutMix); evaluated
  by clip and video top-1; ends with a classifier.
- :class:`MaskedAutoencoding` (``--objective mae``): a VideoMAE-style masked
  autoencoder of a ``videovit-*`` encoder on the clips alone; evaluated by the
  masked-reconstruction loss; ends with the encoder's weights under the
  classifier's names, which ``--model.weights`` fine-tunes.

A new objective is one more class here and one more name in :data:`OBJECTIVES`.
The settings object ``s`` of every method is :class:`.settings.TrainSettings`
(not imported: the settings import this module).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from clipforge.inference.evaluation import evaluate_on_ranks, reconstruction_on_ranks
from clipforge.models.builders import Architecture, architecture
from clipforge.models.mae import encoder_state, mae_architecture


class Objective:
    """One objective; every run asks :func:`objective_of` for its own."""

    name: ClassVar[str]
    headline: ClassVar[str]
    """The evaluation metric that sums up a run (the run's last line, the record's headline)."""
    headline_words: ClassVar[str]
    figures: ClassVar[tuple[str, ...]]
    """The evaluation metrics that go to TensorBoard."""

    def problem(self, s: Any) -> str | None:
        """What in the settings this objective cannot do, in one line (None: nothing)."""
        return None

    def architecture(self, s: Any, classes: int, frames: int, size: int) -> Architecture:
        """What the engine trains."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor | None, s: Any):
        """The training loss of one micro-batch, from the model's output."""
        raise NotImplementedError

    def evaluate(self, forward, dataset, s: Any, rank: int, world_size: int, device) -> dict[str, Any]:
        """The evaluation of ``forward`` (the engine) on ``dataset``, every rank taking its share."""
        raise NotImplementedError

    def describe(self, metrics: dict[str, Any]) -> str:
        """An evaluation in words, for the run's log."""
        raise NotImplementedError

    def final_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights the run ends with, from the engine's consolidated state."""
        return state

    def annotate(self, record: Any, s: Any) -> None:
        """What the run's record (:class:`clipforge.rundir.RunRecord`) says of this objective."""


class Classify(Objective):
    name, headline, headline_words = "classify", "video_top1", "video top-1"
    figures = ("loss", "clip_top1", "clip_top5", "video_top1", "video_top5")

    def architecture(self, s: Any, classes: int, frames: int, size: int) -> Architecture:
        return architecture(s.model.name, classes, frames, size, **s.model.overrides())

    def loss(self, output: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor | None, s: Any):
        """Cross-entropy against class indices, or against soft targets ``[B, classes]`` (mixup, CutMix)."""
        weight = class_weights.to(output.device) if class_weights is not None else None
        target = labels.float() if labels.is_floating_point() else labels.long()
        return F.cross_entropy(output.float(), target, weight=weight, label_smoothing=s.optim.label_smoothing)

    def evaluate(self, forward, dataset, s: Any, rank: int, world_size: int, device) -> dict[str, Any]:
        return evaluate_on_ranks(
            forward, dataset, s.batch_per_rank, s.data.crop, rank, world_size, device, s.data.workers
        )

    def describe(self, metrics: dict[str, Any]) -> str:
        return (
            f"{metrics['split']} loss {metrics['loss']:.4f}, clip top-1 {metrics['clip_top1']:.3f}, "
            f"video top-1 {metrics['video_top1']:.3f} ({metrics['videos']} videos)"
        )


class MaskedAutoencoding(Objective):
    name, headline, headline_words = "mae", "loss", "reconstruction loss"
    figures = ("loss",)

    def problem(self, s: Any) -> str | None:
        m = s.model
        if not m.name.startswith("videovit-"):
            return f"--objective mae pretrains a videovit-* encoder; {m.name} is not one"
        if m.attention == "divided" or m.pool == "cls":
            return "--objective mae: the encoder sees a subset of tokens, so joint attention and mean pooling"
        if m.weights is not None:
            return "--objective mae starts from scratch; drop --model.weights (fine-tuning takes it)"
        if s.data.mixup or s.data.cutmix or s.optim.layer_decay != 1:
            return "--objective mae: mixup, CutMix and layer decay are fine-tuning settings; drop them"
        if s.data.class_balance == "loss" or s.optim.label_smoothing:
            return (
                "--objective mae: a loss weighted by class or smoothed labels acts on labels, which pretraining does "
                "not read; drop --data.class-balance loss and --optim.label-smoothing"
            )
        if s.parallel.activation_checkpointing:
            return (
                "--objective mae: the autoencoder is one segment, so activation checkpointing would recompute all of "
                "it and save no memory; drop --parallel.activation-checkpointing"
            )
        return s.mae.problem()

    def architecture(self, s: Any, classes: int, frames: int, size: int) -> Architecture:
        return mae_architecture(s.model.name, frames, size, s.mae, **s.model.overrides())

    def loss(self, output: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor | None, s: Any):
        """The autoencoder's forward is its own loss; the labels play no part."""
        return output.float()

    def evaluate(self, forward, dataset, s: Any, rank: int, world_size: int, device) -> dict[str, Any]:
        return reconstruction_on_ranks(
            forward, dataset, s.batch_per_rank, s.data.crop, rank, world_size, device, s.data.workers, seed=s.seed
        )

    def describe(self, metrics: dict[str, Any]) -> str:
        return f"{metrics['split']} reconstruction loss {metrics['loss']:.4f} ({metrics['clips']} clips)"

    def final_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return encoder_state(state)  # the encoder alone, under the classifier's names

    def annotate(self, record: Any, s: Any) -> None:
        record.pretraining = {"objective": self.name, **dataclasses.asdict(s.mae)}


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (Classify(), MaskedAutoencoding())}


def objective_of(s: Any) -> Objective:
    """The objective of the settings ``s`` (their ``objective`` field names it)."""
    return OBJECTIVES[s.objective]
