"""How the DeepSpeed engine holds the model, chosen once by name: ``plain`` or ``pipeline``.

Everything that differs between a model replicated (and ZeRO-sharded) on every
rank and a model cut into pipeline stages lives behind the small interface of
:class:`EngineLayout`: the module handed to ``deepspeed.initialize``, which
data-parallel group a rank is in, one optimizer step, whether the model can
be evaluated while training, and the consolidated fp32 weights at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from .builders import start_from
from .evaluation import evaluate_model

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class EngineLayout(Protocol):
    evaluates_while_training: ClassVar[bool]
    """Whether every rank can run the model forward on its own (a pipeline needs all stages)."""

    def module(self, t: Trainer) -> torch.nn.Module:
        """The module for ``deepspeed.initialize``."""

    def data_parallel_rank(self, t: Trainer) -> int:
        """This rank's index among the data-parallel replicas (stages of one pipeline share it)."""

    def train_step(self, t: Trainer, batches: Batches) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; the loss averaged over replicas."""

    def final_state(self, t: Trainer, tag: str) -> dict[str, torch.Tensor]:
        """fp32 weights of the plain model from checkpoint ``tag`` (rank 0; empty elsewhere)."""

    def final_metrics(self, t: Trainer, state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """The final evaluation (on rank 0 at least)."""


class PlainLayout:
    """The whole model on every rank: plain data parallel, ZeRO 1-3, offload."""

    evaluates_while_training: ClassVar[bool] = True

    def module(self, t: Trainer) -> torch.nn.Module:
        model = t.arch.build(seed=t.settings.seed)
        if t.settings.model.weights is not None:
            fresh = start_from(model, t.settings.model.weights)
            if fresh and t.dist.is_main:
                log.warning(
                    "%s: classifier %s of another shape (other classes): trained from scratch",
                    t.settings.model.weights,
                    ", ".join(fresh),
                )
        return _Checkpointed(model) if t.settings.parallel.activation_checkpointing else model

    def data_parallel_rank(self, t: Trainer) -> int:
        return t.dist.rank

    def train_step(self, t: Trainer, batches: Batches) -> float:
        losses = []
        for _ in range(t.settings.grad_accum):
            clips, labels = next(batches)
            loss = t.loss(t.engine(clips), labels)
            t.engine.backward(loss)
            t.engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        if t.dp_size > 1:
            torch.distributed.all_reduce(mean)
            mean /= t.dp_size
        return float(mean.item())

    def final_state(self, t: Trainer, tag: str) -> dict[str, torch.Tensor]:
        if not t.dist.is_main:
            return {}
        if t.settings.parallel.zero_stage == 0:
            return _stage0_fp32_state(t)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(t.checkpoints.folder), tag=tag)
        return {k: v.float() for k, v in state.items()}

    def final_metrics(self, t: Trainer, state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        return t.evaluate()


class PipelineLayout:
    """The model cut into ``pipeline_stages`` stages (DeepSpeed's PipelineModule), ZeRO 0 or 1 within a stage."""

    evaluates_while_training: ClassVar[bool] = False

    def module(self, t: Trainer) -> torch.nn.Module:
        from deepspeed.pipe import LayerSpec, PipelineModule

        p = t.settings.parallel
        module = PipelineModule(
            layers=[LayerSpec(make, *args) for make, args in t.arch.layers],
            num_stages=p.pipeline_stages,
            loss_fn=t.loss,
            partition_method=p.partition_method,
            activation_checkpoint_interval=1 if p.activation_checkpointing else 0,
            seed_layers=True,
            seed_fn=torch.manual_seed,
            base_seed=t.settings.seed,
        )
        # DeepSpeed sums the squared gradient norm over the model-parallel group (here: every stage
        # of one data-parallel replica) but, Megatron-style, counts a parameter not marked
        # model-parallel only on model-parallel rank 0, as if it were a tensor-parallel copy. Without
        # tensor slicing every stage holds parameters of its own, so all of them are marked: the
        # clipping norm is then the whole model's, as in one process.
        for param in module.parameters():
            param.model_parallel = True
        return module

    def data_parallel_rank(self, t: Trainer) -> int:
        return t.engine.grid.data_parallel_id

    def train_step(self, t: Trainer, batches: Batches) -> float:
        return float(t.engine.train_batch(data_iter=batches).item())

    def final_state(self, t: Trainer, tag: str) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        if t.dist.is_main:
            # DeepSpeed saves pipeline layer i as layer_<i>-model_states.pt; the plain model names it "<i>.".
            for path in sorted(t.checkpoints.path(tag).glob("layer_*-model_states.pt")):
                index = int(path.name.split("_")[1].split("-")[0])
                for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
                    state[f"{index}.{key}"] = value.float()
        return state

    def final_metrics(self, t: Trainer, state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        if not t.dist.is_main:
            return None
        model = t.arch.build(seed=t.settings.seed)
        model.load_state_dict(state)
        return evaluate_model(model, t.eval_set, t.settings.batch_per_rank, t.settings.data.crop)


LAYOUTS: dict[str, type[EngineLayout]] = {"plain": PlainLayout, "pipeline": PipelineLayout}


def _stage0_fp32_state(t: Trainer) -> dict[str, torch.Tensor]:
    """Without ZeRO the module holds the weights; at bf16 or fp16 its optimizer holds the fp32 masters.

    DeepSpeed's zero_to_fp32 cannot read a stage-0 checkpoint (it has no parameter shapes), so
    the masters come from the live optimizer, in the order of the trainable parameters.
    """
    state = {k: v.detach().float().cpu() for k, v in t.engine.module.state_dict().items()}
    masters = [m for group in getattr(t.engine.optimizer, "fp32_groups", None) or [] for m in group]
    if t.settings.precision != "fp32" and masters:
        names = [n for n, p in t.engine.module.named_parameters() if p.requires_grad]
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
