#!/usr/bin/env python3
"""Benchmark of the training loop: clipforge's Trainer beside a bare PyTorch loop of the same model, in one process.

    python jobs/bench/loop.py                  # CPUs: videovit-small, 4 layers, 8x64x64 clips, batch 4, bf16
    python jobs/bench/loop.py --gpu            # a GPU: videovit-base, 16x224x224, batch 8 and 32, eager and compiled
    python jobs/bench/loop.py --gpu --models videovit-base videovit-large --batches 8 --compile False

For each configuration one process builds both sides: the Trainer (DeepSpeed
engine, clip store, DataLoader, augmentation on the device, log windows,
background checkpoints) and the bare loop (the same architecture from
``clipforge.models.builders``, random clips already on the device, torch's
AdamW, the same loss, gradient clipping and bf16 form, no framework and no
loader). After a warm-up they take turns, ``--rounds`` times, each for
``--window`` steps timed between device synchronisations, alternating which
goes first. The ratio of a round is the Trainer's clips/s over the bare loop's;
the table gives the median ratio and the spread (min-max) of the rounds, MFU,
and what a checkpoint costs the Trainer: the time the loop was blocked beside
the time the write took in the background.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
import tyro


@dataclasses.dataclass
class Config:
    """Time the Trainer beside a bare loop of its own model."""

    gpu: bool = False
    """GPU defaults: videovit-base, 16x224x224 (stored 240, cropped), batch 8 and 32, eager and compiled."""
    models: tuple[str, ...] | None = None
    """Models to time (default: videovit-small on CPUs, videovit-base on a GPU)."""
    depth: int | None = None
    """Override the transformer's depth (default: 4 on CPUs, the model's own on a GPU)."""
    frames: int | None = None
    """Frames per clip (default 8 on CPUs, 16 on a GPU)."""
    size: int | None = None
    """Training crop (default 64 on CPUs, 224 on a GPU); the store keeps frames of this size + 16 on a GPU."""
    batches: tuple[int, ...] | None = None
    """Clips per step (default 4 on CPUs; 8 and 32 on a GPU)."""
    compile: tuple[bool, ...] | None = None
    """Eager, compiled or both (default: eager on CPUs, both on a GPU)."""
    zero_stage: int = 0
    """ZeRO stage of the Trainer."""
    bf16_mode: Literal["auto", "autocast", "weights"] = "auto"
    """The Trainer's bf16 form; the bare loop uses the same one."""
    codec: Literal["raw", "jpeg"] = "raw"
    """The store's codec."""
    decode: Literal["host", "device"] = "host"
    """jpeg stores: decode in the loader's workers or on the device."""
    workers: int | None = None
    """DataLoader workers of the Trainer (default 1 on CPUs, 8 on a GPU)."""
    warmup: int = 5
    """Steps each side runs before timing (the Trainer's first step also compiles)."""
    window: int = 10
    """Steps per timed turn (the Trainer's log window)."""
    rounds: int = 5
    """Turns per side."""
    checkpoints: int = 3
    """Checkpoints the Trainer writes after the timed rounds, each while it trains a window."""
    work: Path | None = None
    """Folder for the store and the runs (default: a temporary one)."""
    out: Path | None = None
    """Also write the table as Markdown here."""
    one: str | None = None
    """Internal: run one configuration (JSON) and write its figures to --result."""
    result: Path | None = None
    """Internal: where one configuration's figures go."""


@dataclasses.dataclass
class Case:
    model: str
    depth: int | None
    frames: int
    size: int
    stored: int
    batch: int
    compile: bool
    zero_stage: int
    bf16_mode: str
    codec: str
    decode: str
    workers: int
    warmup: int
    window: int
    rounds: int
    checkpoints: int
    store: str
    run: str

    @property
    def label(self) -> str:
        depth = f" ({self.depth} layers)" if self.depth else ""
        data = f", {self.codec} store" + (f", {self.decode} decode" if self.codec == "jpeg" else "")
        mode = "compiled" if self.compile else "eager"
        return f"{self.model}{depth}, batch {self.batch}, {mode}, ZeRO-{self.zero_stage}{data}"


class BareLoop:
    """The same model trained with nothing around it: clips on the device, AdamW, the loss, clipping."""

    def __init__(self, arch, case: Case, form: str, clip_grad: float, device: torch.device) -> None:
        self.device, self.form, self.clip_grad = device, form, clip_grad
        model = arch.build(seed=0).to(device)
        if form == "weights":
            model = model.to(torch.bfloat16)
        self.model = torch.compile(model) if case.compile else model
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=cuda)
        g = torch.Generator().manual_seed(0)
        shape = (case.batch, case.frames, case.size, case.size, 3)
        self.clips = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
        self.labels = torch.randint(0, 6, (case.batch,), generator=g).to(device)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.form == "autocast"):
                logits = self.model(self.clips)
            loss = torch.nn.functional.cross_entropy(logits.float(), self.labels)
            loss.backward()
            if self.clip_grad:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(case: Case, out: Path) -> None:
    """One configuration, both sides in this process (a single rank)."""
    from clipforge.base.logs import setup_logging
    from clipforge.train.engine import bf16_form
    from clipforge.train.settings import TrainSettings
    from clipforge.train.trainer import Trainer

    setup_logging(0)
    s = TrainSettings(run_dir=Path(case.run), batch_per_rank=case.batch, precision="bf16", compile=case.compile)
    s.bf16_mode = case.bf16_mode
    s.model.name, s.model.depth = case.model, case.depth
    s.data.store, s.data.workers, s.data.decode = Path(case.store), case.workers, case.decode
    s.data.crop = case.size if case.stored != case.size else None
    s.data.eval_split = "val"
    s.steps = case.warmup + case.window * (case.rounds + case.checkpoints) + 1
    s.log_every, s.eval_every, s.checkpoint_every = case.window, 10 * s.steps, 10 * s.steps
    s.optim.warmup_steps = 2
    trainer = Trainer(s)
    with trainer.session():
        trainer.start()
        device = trainer.device
        parameters = sum(p.numel() for p in trainer.engine.module.parameters())
        form = bf16_form(s, parameters)[0]
        bare = BareLoop(trainer.arch, case, form, s.optim.clip_grad, device)
        trainer.run(until=trainer.step + case.warmup)
        bare.run(case.warmup)
        synchronize(device)
        ratios, trainer_s, bare_s = [], [], []
        for r in range(case.rounds):
            times = {}
            for side in ("trainer", "bare") if r % 2 == 0 else ("bare", "trainer"):
                synchronize(device)
                start = time.perf_counter()
                if side == "trainer":
                    trainer.run(until=trainer.step + case.window)
                else:
                    bare.run(case.window)
                synchronize(device)
                times[side] = time.perf_counter() - start
            trainer_s.append(times["trainer"])
            bare_s.append(times["bare"])
            ratios.append(times["bare"] / times["trainer"])
        for _ in range(case.checkpoints):
            trainer.checkpointer.wait()  # the previous write done, as at any sane interval: this save's own wait
            trainer.checkpointer.save(trainer.step)
            trainer.run(until=trainer.step + case.window)
        flops = trainer.arch.flops() if trainer.arch.flops else None
        peak = trainer.throughput.peak
        trainer.finish()
    # The background checkpoints' records (the final one, written with the loop waiting, is left out).
    saved = [r for r in trainer.run_dir.metrics("checkpoint") if r["step"] < s.steps]
    data_wait = [r["data_wait"] for r in trainer.run_dir.metrics("throughput")]
    clips = case.batch * case.window
    median_trainer = statistics.median(trainer_s)
    result = {
        "label": case.label,
        "form": form,
        "ratios": ratios,
        "trainer_clips_s": clips / median_trainer,
        "bare_clips_s": clips / statistics.median(bare_s),
        "tflops": 3 * flops * clips / median_trainer / 1e12 if flops else None,
        "peak_tflops": peak.tflops if peak else None,
        "peak_source": peak.source if peak else None,
        "checkpoints": saved,
        "data_wait": statistics.median(data_wait) if data_wait else None,
    }
    out.write_text(json.dumps(result))


def cases(cfg: Config, work: Path) -> list[Case]:
    from clipforge.preprocess import synthetic

    gpu = cfg.gpu
    models = cfg.models or (("videovit-base",) if gpu else ("videovit-small",))
    depth = cfg.depth if cfg.depth is not None else (None if gpu else 4)
    frames = cfg.frames or (16 if gpu else 8)
    size = cfg.size or (224 if gpu else 64)
    stored = size + 16 if gpu else size
    batches = cfg.batches or ((8, 32) if gpu else (4,))
    compiles = cfg.compile or ((False, True) if gpu else (False,))
    workers = cfg.workers if cfg.workers is not None else (8 if gpu else 1)
    store = work / f"store-{frames}x{stored}-{cfg.codec}"
    if not (store / "index.h5").exists():
        synthetic.write_store(store, videos_per_class=4, clip_frames=frames, size=stored, codec=cfg.codec)
    found = []
    for model in models:
        for batch in batches:
            for compiled in compiles:
                found.append(
                    Case(
                        model,
                        depth,
                        frames,
                        size,
                        stored,
                        batch,
                        compiled,
                        cfg.zero_stage,
                        cfg.bf16_mode,
                        cfg.codec,
                        cfg.decode,
                        workers,
                        cfg.warmup,
                        cfg.window,
                        cfg.rounds,
                        cfg.checkpoints,
                        str(store),
                        str(work / f"run-{len(found)}"),
                    )
                )
    return found


def main(cfg: Config) -> int:
    work = cfg.work or Path(tempfile.mkdtemp(prefix="clipforge-bench-loop-"))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    rows = []
    for case in cases(cfg, work):
        out = work / f"{Path(case.run).name}.json"
        shutil.rmtree(case.run, ignore_errors=True)  # a run directory left by an earlier benchmark would resume
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(_free_port())
        argv = [sys.executable, "-m", "clipforge.jobs.bench.loop", "--one", json.dumps(dataclasses.asdict(case))]
        result = subprocess.run([*argv, "--result", str(out)], env=env, capture_output=True, text=True)
        if result.returncode:
            print(f"{case.label}: failed\n{result.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(out.read_text()))
        print(f"  {case.label}: trainer/bare {statistics.median(rows[-1]['ratios']):.2f}", file=sys.stderr, flush=True)
    lines = table(rows, device, cfg)
    print("\n".join(lines))
    if cfg.out is not None:
        cfg.out.write_text("\n".join(lines) + "\n")
    return 0


def table(rows: list[dict], device: str, cfg: Config) -> list[str]:
    lines = [
        f"Trainer beside a bare loop of the same model, bf16, on {device} (torch {torch.__version__}), "
        f"{time.strftime('%Y-%m-%d')}: {cfg.rounds} alternating rounds of {cfg.window} steps per side.",
        "",
        "| configuration | bf16 form | trainer clips/s | bare clips/s | trainer/bare (min-max) | MFU "
        "| checkpoint blocked s | written s | GB |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratios = r["ratios"]
        mfu = f"{r['tflops'] / r['peak_tflops']:.1%}" if r["tflops"] and r["peak_tflops"] else "-"
        saved = r["checkpoints"]
        blocked = statistics.median(c["blocked_s"] for c in saved) if saved else float("nan")
        written = statistics.median(c["written_s"] for c in saved) if saved else float("nan")
        size = saved[0]["bytes"] / 1e9 if saved else float("nan")
        lines.append(
            f"| {r['label']} | {r['form']} | {r['trainer_clips_s']:.1f} | {r['bare_clips_s']:.1f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {mfu} "
            f"| {blocked:.3f} | {written:.3f} | {size:.2f} |"
        )
    if rows and rows[0]["peak_tflops"]:
        lines.append(f"\nMFU against {rows[0]['peak_tflops']:.1f} TFLOP/s ({rows[0]['peak_source']}).")
    lines.append(
        "Checkpoints: medians of the run's background checkpoints; blocked is the loop's wait (snapshot to host "
        "memory), written the time until complete.json."
    )
    return lines


def _free_port() -> int:
    from clipforge.hpc.distenv import free_port

    return free_port()


if __name__ == "__main__":
    config = tyro.cli(Config)
    if config.one is not None:
        run_one(Case(**json.loads(config.one)), config.result)
    else:
        sys.exit(main(config))
