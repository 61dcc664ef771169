"""The DeepSpeed engine of a run: its config, its mixed precision, its parameter groups and torch.compile.

bf16 comes in two forms. DeepSpeed's ``torch_autocast`` keeps fp32 weights and
runs the forward under ``torch.autocast``: its optimizer step is a plain
(fused) AdamW, the fastest path on a GPU. Its ``bf16`` mode keeps bf16 weights
with fp32 masters in its own optimizer: half the weight and activation memory,
which is what ZeRO-3, pipelines and the billion-parameter sizes need, at a
fixed cost per step. ``--bf16-mode auto`` picks per layout and says which.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import torch

from clipforge.hpc.distenv import DistEnv
from clipforge.models.builders import Architecture

from .parallel import deepspeed_config
from .resume import ResumePlan
from .settings import TrainSettings

log = logging.getLogger(__name__)

BIG_MODEL = 300_000_000
"""Parameters from which bf16 weights (half the memory) win over autocast's fp32 weights."""


def bf16_form(s: TrainSettings, parameters: int) -> tuple[Literal["autocast", "weights"], str]:
    """Which bf16 form a run uses, and why (for the log)."""
    if s.bf16_mode != "auto":
        return s.bf16_mode, "as asked (--bf16-mode)"
    p = s.parallel
    if p.zero_stage == 3 or p.offload_params or p.offload_optimizer:
        return "weights", f"ZeRO-{p.zero_stage} with its memory savings"
    if p.layout == "pipeline":
        return "weights", "a pipeline sends bf16 activations between stages"
    if parameters >= BIG_MODEL:
        return "weights", f"{parameters / 1e9:.2f} B parameters: bf16 weights halve their memory"
    return "autocast", "fp32 weights under torch.autocast: no master-weight copy in the optimizer step"


def build_engine(
    s: TrainSettings,
    arch: Architecture,
    module: torch.nn.Module,
    plan: ResumePlan,
    dist: DistEnv,
    device: torch.device,
    has_batchnorm: bool,
) -> Any:
    """``deepspeed.initialize`` of ``module`` with the run's config (and compiled, where asked or on a GPU)."""
    import deepspeed

    parameters = sum(p.numel() for p in module.parameters())
    form, why = bf16_form(s, parameters)
    if s.precision == "bf16" and dist.is_main:
        log.info("bf16 as %s: %s", "autocast" if form == "autocast" else "bf16 weights with fp32 masters", why)
    _advise_zero(s, parameters, dist, device)
    config = deepspeed_config(
        s.parallel,
        dist.world_size,
        s.batch_per_rank,
        plan.grad_accum,
        s.precision,
        s.optim.deepspeed_optimizer(fused=device.type == "cuda" and not s.parallel.offload_optimizer),
        s.optim.deepspeed_scheduler(s.steps),
        s.optim.clip_grad,
        has_batchnorm,
        load_universal=plan.reshard,
        bf16_autocast=form == "autocast",
    )
    groups = parameter_groups(module, len(arch.layers), s.optim.lr, s.optim.layer_decay)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups, config=config)
    if s.parallel.layout == "plain" and s.parallel.zero_stage == 0 and s.parallel.data_parallel(dist.world_size) == 1:
        # One data-parallel rank: DeepSpeed would still flatten every gradient, all-reduce it with itself and
        # copy it back, each step (about 5% of a small model's step on CPUs).
        engine.enable_backward_allreduce = False
    if (
        s.parallel.layout == "plain"
        and s.parallel.zero_stage == 0
        and not (s.precision == "bf16" and form == "weights")
    ):
        # DeepSpeed clips fp32 gradients with a norm kernel and a multiply per parameter and an all-reduce of the
        # norm; at ZeRO-0 every rank holds the whole all-reduced gradient, so torch's foreach clipping (a few
        # kernels for all parameters) computes the same norm.
        clip = s.optim.clip_grad
        engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(
            engine.module.parameters(), clip, foreach=True
        )
    if compiles(s, device):
        # Dynamo's own fallback: a graph it cannot compile runs eagerly, with a warning, not a failure.
        torch._dynamo.config.suppress_errors = True
        engine.compile()
        if dist.is_main:
            log.info("torch.compile on (the first steps compile; a graph that fails to compile runs eagerly)")
    return engine


def compiles(s: TrainSettings, device: torch.device) -> bool:
    """``--compile`` as given, or on by default on a GPU."""
    return s.compile if s.compile is not None else device.type == "cuda"


def _advise_zero(s: TrainSettings, parameters: int, dist: DistEnv, device: torch.device) -> None:
    """Say so when the ZeRO stage asked for buys nothing here, and which stage would do."""
    p = s.parallel
    if not dist.is_main or p.zero_stage == 0 or p.offload_optimizer or p.offload_params:
        return
    dp = p.data_parallel(dist.world_size)
    if dp == 1:
        log.warning(
            "ZeRO-%d shards over data-parallel ranks and this job has one: it saves no memory and adds its "
            "per-parameter hooks to every step; --parallel.zero-stage 0 is faster here",
            p.zero_stage,
        )
    elif device.type == "cuda" and p.zero_stage >= 2:
        states = 16 * parameters  # bf16 weights and gradients, fp32 masters and Adam moments
        memory = torch.cuda.get_device_properties(device).total_memory
        if states < memory / 4:
            log.info(
                "the model states (%.1f GB unsharded) fit in a quarter of this GPU's %.0f GB: ZeRO-1 shards the "
                "optimizer state without ZeRO-%d's per-parameter gradient hooks (--parallel.zero-stage 1)",
                states / 1e9,
                memory / 1e9,
                p.zero_stage,
            )


def has_batchnorm(arch: Architecture) -> bool:
    """Whether the model has BatchNorm layers (their running statistics must follow bf16 weights)."""
    # Every layer is built on the meta device: no memory for its weights, so a billion-parameter model costs nothing.
    with torch.device("meta"):
        return any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            for make, args in arch.layers
            for m in make(*args).modules()
        )


def class_weights(labels: np.ndarray, classes: int) -> torch.Tensor:
    """Inverse class frequency, normalised to a mean of one over the classes (``--data.class-balance loss``)."""
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    return torch.tensor(counts.sum() / (len(counts) * np.maximum(counts, 1)), dtype=torch.float32)


def parameter_groups(model: torch.nn.Module, layers: int, lr: float, decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in optimizer groups: one per layer with layer-wise learning-rate decay.

    Parameters are named by their layer's index (``3.attn.qkv.weight``), in a plain model and in a
    pipeline stage alike; layer ``i`` of ``layers`` learns at ``lr x decay^(layers - 1 - i)``, as in
    BEiT and VideoMAE. DeepSpeed's warm-up and cosine schedule scale each group's own rate.
    """
    if decay == 1.0:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    by_layer: dict[int, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            by_layer.setdefault(int(name.split(".")[0]), []).append(param)
    return [{"params": params, "lr": lr * decay ** (layers - 1 - i)} for i, params in sorted(by_layer.items())]
