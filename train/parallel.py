"""How a model is spread over ranks: ZeRO stage, offload, pipeline stages, and the DeepSpeed config they make.

The DeepSpeed config is always generated from these settings, never written
by hand per run. Combinations DeepSpeed would reject deep inside its engine
(or worse, accept and misbehave) are refused here first, one line each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from clipforge.base.errors import UserError

Precision = Literal["fp32", "bf16", "fp16"]


class ParallelError(UserError):
    """A parallel layout that cannot work; the message says what to change."""


@dataclasses.dataclass
class ParallelConfig:
    """ZeRO, offload and pipeline settings."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 plain data parallel, 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    offload_optimizer: bool = False
    """ZeRO-Offload: keep optimizer state and its step on the CPU (stages 1-3)."""
    offload_params: bool = False
    """ZeRO-Infinity style: keep parameters on the CPU between uses (stage 3 only)."""
    pipeline_stages: int = 1
    """Pipeline stages (1: no pipeline). Must divide the number of ranks."""
    partition_method: str = "parameters"
    """How layers are split over stages: parameters, uniform, or type:<LayerClass>."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass instead of storing them."""

    def check(self, world_size: int, splittable: bool, model: str) -> None:
        if self.pipeline_stages < 1:
            raise ParallelError(f"pipeline_stages: must be at least 1, got {self.pipeline_stages}")
        if self.pipeline_stages > 1:
            if self.zero_stage >= 2:
                # DeepSpeed asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism".
                raise ParallelError(
                    f"zero_stage {self.zero_stage} cannot be combined with pipeline_stages {self.pipeline_stages}; use "
                    "ZeRO 0 or 1 with a pipeline"
                )
            if world_size % self.pipeline_stages:
                raise ParallelError(
                    f"pipeline_stages {self.pipeline_stages} does not divide the {world_size} ranks; choose a divisor "
                    f"of {world_size}"
                )
            if not splittable:
                raise ParallelError(
                    f"model {model} cannot be cut into pipeline stages; train it with pipeline_stages 1 and ZeRO "
                    "instead"
                )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ParallelError("offload_optimizer needs zero_stage 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ParallelError("offload_params needs zero_stage 3")

    @property
    def layout(self) -> Literal["plain", "pipeline"]:
        """How the engine holds the model: one module per rank, or stages of a pipeline."""
        return "pipeline" if self.pipeline_stages > 1 else "plain"

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.pipeline_stages


def global_batch(batch_per_rank: int, grad_accum: int, data_parallel: int) -> int:
    """Clips per optimizer step: each data-parallel rank's micro-batch, times the micro-batches it accumulates.

    The one place it is computed: the step count of ``--epochs``, DeepSpeed's config, the meters and the
    checkpoint's record (which an elastic restart keeps) all take it from here."""
    return batch_per_rank * grad_accum * data_parallel


def deepspeed_config(
    parallel: ParallelConfig,
    world_size: int,
    batch_per_rank: int,
    grad_accum: int,
    precision: Precision,
    optimizer: dict[str, Any],
    scheduler: dict[str, Any] | None,
    clip_grad: float,
    has_batchnorm: bool,
    load_universal: bool = False,
    bf16_autocast: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config for one run, from the run's own settings.

    ``bf16_autocast``: bf16 as fp32 weights under ``torch.autocast`` (DeepSpeed's ``torch_autocast``)
    rather than bf16 weights with fp32 masters.
    """
    if batch_per_rank < 1 or grad_accum < 1:
        raise ParallelError(f"batch_per_rank ({batch_per_rank}) and grad_accum ({grad_accum}) must be at least 1")
    dp = parallel.data_parallel(world_size)
    config: dict[str, Any] = {
        "train_batch_size": global_batch(batch_per_rank, grad_accum, dp),
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip_grad,
        "optimizer": optimizer,
        "zero_optimization": {"stage": parallel.zero_stage},
        "steps_per_print": 10**9,  # our own progress line reports; DeepSpeed's would repeat it
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises with the device at the start and end of every step by
        # default: the host then waits for each step, and the GPU idles while the next one is launched.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if scheduler is not None:
        config["scheduler"] = scheduler
    if precision == "bf16" and bf16_autocast:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
        if has_batchnorm:
            # BatchNorm running statistics must follow the parameters' dtype, or the forward fails.
            config["data_types"] = {"buffer_dtype": "bf16"}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    zero = config["zero_optimization"]
    if parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if parallel.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if parallel.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if load_universal:
        # Resume from a universal checkpoint (ds_to_universal's): its optimizer state is cut per
        # parameter, not per rank, so another number of ranks can partition it again.
        config["checkpoint"] = {"load_universal": True}
    if parallel.activation_checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return config
