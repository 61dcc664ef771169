"""How the DeepSpeed engine holds the model, chosen once by name: ``plain`` or ``pipeline``.

Everything that differs between a model replicated (and ZeRO-sharded) on every
rank and a model cut into pipeline stages lives behind the small interface of
:class:`EngineLayout`: the module handed to ``deepspeed.initialize``, which
data-parallel group a rank is in, one optimizer step (its loss left on the
device), whether the model can be evaluated while training, and the
consolidated fp32 weights at the end. A layout is made from a
:class:`ModelPlan` and knows nothing of the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from clipforge.models.builders import Architecture, start_from
from clipforge.rundir import CheckpointIndex

from .parallel import ParallelConfig, Precision

log = logging.getLogger(__name__)

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class ModelPlan:
    """What a layout builds and trains: the architecture, how it is spread, where its weights start."""

    arch: Architecture
    parallel: ParallelConfig
    precision: Precision
    seed: int
    loss: Loss
    weights: Path | None = None
    """Starting weights (a fresh run only; a resumed one loads its checkpoint)."""
    announce: bool = True
    """Whether this rank logs (rank 0)."""


class EngineLayout(Protocol):
    evaluates_while_training: ClassVar[bool]
    """Whether every rank can run the model forward on its own (a pipeline needs all stages)."""
    losses_are_global: ClassVar[bool]
    """Whether a step's loss is already the mean over the data-parallel replicas."""

    def __init__(self, plan: ModelPlan) -> None: ...

    def module(self) -> torch.nn.Module:
        """The module for ``deepspeed.initialize``."""

    def data_parallel_rank(self, engine: Any, rank: int) -> int:
        """This rank's index among the data-parallel replicas (stages of one pipeline share it)."""

    def train_step(self, engine: Any, batches: Batches, grad_accum: int) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; its mean loss, left on the device."""

    def final_state(self, engine: Any, checkpoints: CheckpointIndex, tag: str, main: bool) -> dict[str, torch.Tensor]:
        """fp32 weights of the plain model from checkpoint ``tag`` (on rank 0, ``main``; empty elsewhere)."""


class PlainLayout:
    """The whole model on every rank: plain data parallel, ZeRO 1-3, offload."""

    evaluates_while_training: ClassVar[bool] = True
    losses_are_global: ClassVar[bool] = False

    def __init__(self, plan: ModelPlan) -> None:
        self.plan = plan

    def module(self) -> torch.nn.Module:
        p = self.plan
        model = p.arch.build(seed=p.seed)
        if p.weights is not None:
            fresh = start_from(model, p.weights)
            if fresh and p.announce:
                log.warning(
                    "%s: classifier %s new (other classes, or an encoder from pretraining): trained from scratch",
                    p.weights,
                    ", ".join(fresh),
                )
        return _Checkpointed(model) if p.parallel.activation_checkpointing else model

    def data_parallel_rank(self, engine: Any, rank: int) -> int:
        return rank

    def train_step(self, engine: Any, batches: Batches, grad_accum: int) -> torch.Tensor:
        losses = []
        for _ in range(grad_accum):
            clips, labels = next(batches)
            loss = self.plan.loss(engine(clips), labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def final_state(self, engine: Any, checkpoints: CheckpointIndex, tag: str, main: bool) -> dict[str, torch.Tensor]:
        if not main:
            return {}
        if self.plan.parallel.zero_stage == 0:
            return _stage0_fp32_state(engine, self.plan.precision)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints.folder), tag=tag)
        return {k: v.float() for k, v in state.items()}


class PipelineLayout:
    """The model cut into ``pipeline_stages`` stages (DeepSpeed's PipelineModule), ZeRO 0 or 1 within a stage."""

    evaluates_while_training: ClassVar[bool] = False
    losses_are_global: ClassVar[bool] = True  # DeepSpeed averages over replicas and sends it to every stage

    def __init__(self, plan: ModelPlan) -> None:
        self.plan = plan

    def module(self) -> torch.nn.Module:
        from deepspeed.pipe import LayerSpec, PipelineModule

        p = self.plan
        module = PipelineModule(
            layers=[LayerSpec(make, *args) for make, args in p.arch.layers],
            num_stages=p.parallel.pipeline_stages,
            loss_fn=p.loss,
            partition_method=p.parallel.partition_method,
            activation_checkpoint_interval=1 if p.parallel.activation_checkpointing else 0,
            seed_layers=True,
            seed_fn=torch.manual_seed,
            base_seed=p.seed,
        )
        # DeepSpeed sums the squared gradient norm over the model-parallel group (here: every stage
        # of one data-parallel replica) but, Megatron-style, counts a parameter not marked
        # model-parallel only on model-parallel rank 0, as if it were a tensor-parallel copy. Without
        # tensor slicing every stage holds parameters of its own, so all of them are marked: the
        # clipping norm is then the whole model's, as in one process.
        for param in module.parameters():
            param.model_parallel = True
        return module

    def data_parallel_rank(self, engine: Any, rank: int) -> int:
        return engine.grid.data_parallel_id

    def train_step(self, engine: Any, batches: Batches, grad_accum: int) -> torch.Tensor:
        return engine.train_batch(data_iter=batches).detach().float()

    def final_state(self, engine: Any, checkpoints: CheckpointIndex, tag: str, main: bool) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        if main:
            # DeepSpeed saves pipeline layer i as layer_<i>-model_states.pt; the plain model names it "<i>.".
            for path in sorted(checkpoints.path(tag).glob("layer_*-model_states.pt")):
                index = int(path.name.split("_")[1].split("-")[0])
                for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
                    state[f"{index}.{key}"] = value.float()
        return state


LAYOUTS: dict[str, type[EngineLayout]] = {"plain": PlainLayout, "pipeline": PipelineLayout}


def _stage0_fp32_state(engine: Any, precision: Precision) -> dict[str, torch.Tensor]:
    """Without ZeRO the module holds the weights; at bf16 or fp16 its optimizer holds the fp32 masters.

    DeepSpeed's zero_to_fp32 cannot read a stage-0 checkpoint (it has no parameter shapes), so
    the masters come from the live optimizer, in the order of the trainable parameters.
    """
    state = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    masters = [m for group in getattr(engine.optimizer, "fp32_groups", None) or [] for m in group]
    if precision != "fp32" and masters:
        names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        if len(names) != len(masters):
            raise RuntimeError(f"{len(masters)} fp32 master weights for {len(names)} trainable parameters")
        state.update({n: m.detach().float().cpu().view_as(state[n]) for n, m in zip(names, masters)})
    return state


class _Checkpointed(torch.nn.Sequential):
    """Activation checkpointing for a plain model: recompute each layer's activations in backward."""

    def __init__(self, model: torch.nn.Sequential) -> None:
        super().__init__(*model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self:
            trainable = self.training and any(p.requires_grad for p in layer.parameters())
            x = checkpoint(layer, x, use_reentrant=False) if trainable else layer(x)
        return x
