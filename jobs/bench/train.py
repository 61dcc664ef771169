#!/usr/bin/env python3
"""Benchmark of training: memory of each ZeRO stage against the ZeRO paper, and step time against stage 0.

    python jobs/bench/train.py [--ranks 2] [--model videovit-small] [--steps 6]

For each ZeRO stage it starts ``--ranks`` processes under mpiexec, trains a few
bf16 steps with AdamW, and counts the bytes of the tensors each rank holds:
parameters, gradients (just after backward, before the step frees them) and
optimizer state (fp32 master weights, Adam moments). Each figure is printed
beside the paper's formula for mixed-precision Adam (Rajbhandari et al. 2020):
stage 0 16Ψ, stage 1 4Ψ+12Ψ/N, stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N. The peer is plain
``torch.nn.parallel.DistributedDataParallel`` with AdamW at fp32 (16Ψ: weights,
gradients and two moments, 4 bytes each).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import tyro

from clipforge.hpc.accelerator import datasheet_tflops

FORMULA = {
    -1: lambda p, n: 16 * p,
    0: lambda p, n: 16 * p,
    1: lambda p, n: 4 * p + 12 * p / n,
    2: lambda p, n: 2 * p + 14 * p / n,
    3: lambda p, n: 16 * p / n,
}


@dataclasses.dataclass
class Config:
    """Measure model-state bytes and step time of ZeRO 0-3."""

    ranks: int = 2
    """Processes (data-parallel ranks, N in the formulas)."""
    model: str = "videovit-small"
    """Model to train."""
    frames: int = 8
    """Clip length."""
    size: int = 64
    """Frame size."""
    batch: int = 2
    """Clips per rank per step."""
    steps: int = 6
    """Timed steps per stage (after one warm-up step)."""
    stage: int | None = None
    """Internal: run one stage (-1: plain DDP, the peer) as a rank of mpiexec and write its figures to --out."""
    out: Path | None = None
    """Internal: where a stage's figures go."""


def held_bytes(engine, stage: int) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage counted once."""
    seen: set[int] = set()
    totals = {"parameters": 0, "gradients": 0, "optimizer": 0}

    def add(tensor, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        totals[kind] += storage.nbytes()

    for p in engine.module.parameters():
        add(p.ds_tensor if stage == 3 else p.data, "parameters")
    for p in engine.module.parameters():
        add(p.grad, "gradients")
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    for group in inner.param_groups:
        for p in group["params"]:
            add(p.grad, "gradients")
    for name, value in vars(wrapper).items():
        if "grad" in name.lower():
            for t in _tensors(value):
                add(t, "gradients")
    for group in inner.param_groups:
        for p in group["params"]:
            add(p, "optimizer")  # fp32 master weights (or their partition)
    for name, value in vars(wrapper).items():
        # ZeRO-3 hands its fp32 partitions to the inner optimizer only during step(): find them by name.
        if "fp32" in name.lower():
            for t in _tensors(value):
                add(t, "optimizer")
    for state in inner.state.values():
        for t in _tensors(state):
            add(t, "optimizer")
    return totals


def _tensors(value, depth: int = 0):
    if depth > 3:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)


def run_ddp(cfg: Config) -> None:
    """The peer: plain torch DistributedDataParallel with AdamW at fp32 (what DeepSpeed's stages replace)."""
    from clipforge.hpc.distenv import init_process_group, setup_distributed, task_device
    from clipforge.models.builders import architecture

    env = setup_distributed()
    device = task_device(env)  # the current GPU is set before NCCL starts
    cuda = device.type == "cuda"
    init_process_group(env, device, single=True)
    arch = architecture(cfg.model, 10, cfg.frames, cfg.size)
    model = torch.nn.parallel.DistributedDataParallel(
        arch.build(seed=0).to(device), device_ids=[device.index] if cuda else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clips = torch.randint(0, 255, (cfg.batch, cfg.frames, cfg.size, cfg.size, 3), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (cfg.batch,), device=device)
    times = []
    for step in range(cfg.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(clips), labels).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    held = {
        "parameters": sum(p.untyped_storage().nbytes() for p in model.parameters()),
        "gradients": sum(p.grad.untyped_storage().nbytes() for p in model.parameters()),
        "optimizer": sum(
            t.untyped_storage().nbytes()
            for st in optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim()
        ),
    }
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, held)
    if env.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        cfg.out.write_text(
            json.dumps(
                {"stage": "ddp", "parameters": params, "per_rank": gathered, "step_s": sorted(times)[len(times) // 2]}
            )
        )
    torch.distributed.destroy_process_group()


def run_stage(cfg: Config) -> None:
    """One rank of one stage (under mpiexec)."""
    import deepspeed

    if cfg.stage == -1:
        return run_ddp(cfg)

    from clipforge.hpc.distenv import init_process_group, setup_distributed, task_device
    from clipforge.models.builders import architecture
    from clipforge.train.parallel import ParallelConfig, deepspeed_config

    env = setup_distributed()
    init_process_group(env, task_device(env), single=True)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # adopts the group (pipelines)
    arch = architecture(cfg.model, 10, cfg.frames, cfg.size)
    torch.manual_seed(0)
    model = arch.build(seed=0)
    params = sum(p.numel() for p in model.parameters())
    ds = deepspeed_config(
        ParallelConfig(zero_stage=cfg.stage),
        env.world_size,
        cfg.batch,
        1,
        "bf16",
        {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        None,
        1.0,
        False,
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    clips = torch.randint(
        0, 255, (cfg.batch, cfg.frames, cfg.size, cfg.size, 3), dtype=torch.uint8, device=engine.device
    )
    labels = torch.randint(0, 10, (cfg.batch,), device=engine.device)
    counted = None
    times = []
    for step in range(cfg.steps + 1):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(clips).float(), labels)
        engine.backward(loss)
        if step == 1:
            counted = held_bytes(engine, cfg.stage)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    counted["optimizer"] = held_bytes(engine, cfg.stage)["optimizer"]  # Adam's moments exist after the first step
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, counted)
    if env.rank == 0:
        result = {
            "stage": cfg.stage,
            "parameters": params,
            "per_rank": gathered,
            "step_s": sorted(times)[len(times) // 2],
            "flops_per_clip": arch.flops() if arch.flops else None,
        }
        cfg.out.write_text(json.dumps(result))


def main(cfg: Config) -> None:
    from clipforge.hpc.mpi import mpiexec_command

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (-1, 0, 1, 2, 3):
            out = Path(tmp) / f"stage{stage}.json"
            argv = [
                *mpiexec_command(cfg.ranks),
                sys.executable,
                "-m",
                "clipforge.jobs.bench.train",
                "--stage",
                str(stage),
                "--out",
                str(out),
                "--model",
                cfg.model,
                "--frames",
                str(cfg.frames),
                "--size",
                str(cfg.size),
                "--batch",
                str(cfg.batch),
                "--steps",
                str(cfg.steps),
            ]
            subprocess.run(argv, check=True, capture_output=True, text=True)
            results[stage] = json.loads(out.read_text())
    psi = results[0]["parameters"]
    n = cfg.ranks
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(
        f"\n{cfg.model}: Ψ = {psi / 1e6:.1f} M parameters, N = {n} ranks, bf16 + AdamW, {cfg.batch} clips of "
        f"{cfg.frames}x{cfg.size}x{cfg.size} per rank, on {device}\n"
    )
    print(
        f"{'stage':<6} {'params':>9} {'grads':>9} {'optim':>9} {'total/rank':>11} {'formula':>9} {'ratio':>6}  "
        f"{'step s':>7} {'vs stage 0':>10} {'clips/s':>8}"
    )
    for stage, r in results.items():
        label = "ddp" if stage == -1 else str(stage)
        rank0 = r["per_rank"][0]
        total = sum(rank0.values())
        formula = FORMULA[stage](psi, n)
        clips_s = cfg.batch * n / r["step_s"]
        print(
            f"{label:<6} {rank0['parameters'] / 2**20:8.1f}M {rank0['gradients'] / 2**20:8.1f}M "
            f"{rank0['optimizer'] / 2**20:8.1f}M "
            f"{total / 2**20:10.1f}M {formula / 2**20:8.1f}M {total / formula:5.2f}x  {r['step_s']:7.3f} "
            f"{r['step_s'] / results[0]['step_s']:9.2f}x {clips_s:8.1f}"
        )
    peak = datasheet_tflops(device) if device != "CPU" else None
    flops = results[0]["flops_per_clip"]
    if peak and flops:
        achieved = 3 * flops * cfg.batch * n / results[0]["step_s"] / 1e12
        print(f"\nMFU at stage 0: {achieved / (peak * n):.1%} of {peak:.0f} TFLOP/s per device")
    else:
        print("\nMFU: no accelerator peak known for this device (CPU); figures above are for memory and relative speed")


if __name__ == "__main__":
    config = tyro.cli(Config)
    if config.stage is not None:
        run_stage(config)
    else:
        main(config)
