#!/usr/bin/env python3
"""One prepared check of a GPU node: the real Trainer at bf16, a kill and a resume, evaluation, the attention kernel.

    python jobs/gpu_check.py                       # on a GPU: videovit-base, 16x224x224, 40 steps (< 8 min)
    python jobs/gpu_check.py --out gpu-check.md    # also write the table as Markdown
    python jobs/gpu_check.py --model videovit-tiny --depth 2 --frames 8 --size 32 --crop 24 --steps 6 --batch-per-rank 2
                                                   # the same check on CPUs, small enough for the test suite

It makes its own clip store (rendered clips written directly: no MPI, no
source videos), then runs, each as a fresh single-rank process through
``clipforge.jobs.train``:

- ZeRO stage 0, 2 and 3, eager (and stage 0 compiled, with ``--compile``), reporting
  clips/s, TFLOP/s, MFU, the share of time waiting for data, peak memory, and
  how long the mid-run checkpoint blocked the loop beside its background write;
- stage 2 in deterministic mode (``--deterministic``), once through and once
  killed with SIGKILL after its middle checkpoint and started again: the losses
  after the resume must equal the uninterrupted run's, bit for bit;
- multi-view evaluation of the stage-0 model through ``clipforge.jobs.evaluate``,
  in videos/s after the job's start-up;
- jpeg decoding on the device (``--data.decode device``: nvJPEG on CUDA) against
  one CPU core with libjpeg-turbo, on the same frames;
- which scaled-dot-product-attention kernel the model's attention can use.

Each check prints PASS or FAIL on its own line; the exit status is 1 if any failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import tyro

from clipforge.hpc.distenv import free_port
from clipforge.rundir import RunDir


@dataclasses.dataclass
class Config:
    """Check training, resume and evaluation on this machine's first accelerator (or its CPUs)."""

    model: str = "videovit-base"
    """Model to train."""
    depth: int | None = None
    """Override the transformer's depth (small CPU checks)."""
    tubelet: tuple[int, int, int] | None = None
    """Override the tubelet size T x H x W (small CPU checks)."""
    frames: int = 16
    """Frames per clip."""
    size: int = 240
    """Stored frame size; training crops --crop of it."""
    crop: int = 224
    """Training crop (and evaluation's crop size)."""
    steps: int = 40
    """Optimizer steps per run."""
    batch_per_rank: int = 8
    """Clips per step."""
    stages: tuple[int, ...] = (0, 2, 3)
    """ZeRO stages to run."""
    compile: bool = False
    """Also run stage 0 with torch.compile."""
    workers: int = 4
    """DataLoader workers."""
    work: Path | None = None
    """Folder for the store and the runs; default: a temporary one."""
    out: Path | None = None
    """Also write the table as Markdown here."""


@dataclasses.dataclass
class Row:
    name: str
    figures: dict
    losses: dict[int, float]
    seconds: float


def main(cfg: Config) -> int:
    from clipforge.preprocess import synthetic

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    work = cfg.work or Path(tempfile.mkdtemp(prefix="clipforge-gpu-check-"))
    store = work / "store"
    if not (store / "index.h5").exists():
        clips_needed = max(cfg.batch_per_rank * 2, 12)
        per_class = max(4, -(-clips_needed // (2 * len(synthetic.CLASSES))) + 1)
        synthetic.write_store(store, videos_per_class=per_class, clip_frames=cfg.frames, size=cfg.size)
    print(
        f"clipforge GPU check: {cfg.model}, {cfg.frames}x{cfg.crop}x{cfg.crop} clips, bf16, {cfg.steps} steps of "
        f"{cfg.batch_per_rank}, on {device} (torch {torch.__version__}), {datetime.date.today()}",
        flush=True,
    )
    rows: list[Row] = []
    checks: list[tuple[str, bool]] = []
    half = max(cfg.steps // 2, 1)
    runs = [(f"zero-{s}", ["--parallel.zero-stage", str(s), "--compile", "False"]) for s in cfg.stages]
    if cfg.compile:
        runs.append(("zero-0 compiled", ["--parallel.zero-stage", "0", "--compile", "True"]))
    for name, extra in runs:
        row = train(cfg, store, work / name.replace(" ", "-"), extra, half)
        rows.append(row)
        finite = all(v == v and abs(v) < 1e6 for v in row.losses.values()) and len(row.losses) == cfg.steps
        checks.append((f"{name}: {cfg.steps} steps, every loss finite", finite))
    # The resume check runs in deterministic mode, where a GPU repeats itself bit for bit as CPUs do.
    exact = ["--parallel.zero-stage", "2", "--compile", "False", "--deterministic"]
    reference = train(cfg, store, work / "deterministic", exact, half)
    resumed = kill_and_resume(cfg, store, work / "resumed", exact, half)
    after = [s for s in reference.losses if s > half]
    differing = [s for s in after if resumed.get(s) != reference.losses[s]]
    diff = max((abs(resumed.get(s, float("inf")) - reference.losses[s]) for s in after), default=0.0)
    checks.append(
        (
            f"zero-2 (deterministic) killed after step {half} and resumed: {len(after) - len(differing)} of "
            f"{len(after)} losses after the resume equal the uninterrupted run's bit for bit (max |difference| "
            f"{diff:.2e})",
            not differing and len(after) > 0,
        )
    )
    evaluation = evaluate(work / rows[0].name.replace(" ", "-"), cfg.workers)
    checks.append(
        (
            f"evaluation of {rows[0].name} on {evaluation['videos']} videos x {evaluation['views_per_video']} views: "
            f"{evaluation['videos_per_s']:.1f} videos/s after start-up, video top-1 {evaluation['video_top1']:.3f}",
            evaluation["videos"] > 0,
        )
    )
    decode = jpeg_decode(store, cfg.batch_per_rank)
    checks.append(
        (
            f"jpeg decode of {decode['frames']} frames of {decode['size']} on {decode['device']}: "
            f"{decode['device_fps']:.0f} frames/s, {decode['ratio']:.1f}x one CPU core with libjpeg-turbo "
            f"({decode['cpu_fps']:.0f}); mean |difference| {decode['difference']:.2f} levels",
            decode["difference"] < 1.5,
        )
    )
    kernel = attention_kernel(cfg)
    checks.append((f"attention: {kernel}", device == "CPU" or kernel.startswith("flash")))
    lines = table(rows)
    lines += ["", *[f"{'PASS' if ok else 'FAIL'}  {text}" for text, ok in checks]]
    print("\n".join(lines), flush=True)
    if cfg.out is not None:
        cfg.out.write_text(f"GPU check on {device}, {datetime.date.today()}:\n\n" + "\n".join(lines) + "\n")
    return 0 if all(ok for _, ok in checks) else 1


def train_argv(cfg: Config, store: Path, run: Path, extra: list[str], checkpoint_every: int) -> list[str]:
    argv = [sys.executable, "-m", "clipforge.jobs.train", "--data.store", str(store), "--run-dir", str(run)]
    argv += ["--model.name", cfg.model, "--steps", str(cfg.steps), "--batch-per-rank", str(cfg.batch_per_rank)]
    argv += ["--precision", "bf16", "--data.crop", str(cfg.crop), "--data.workers", str(cfg.workers)]
    argv += ["--checkpoint-every", str(checkpoint_every), "--eval-every", str(10 * cfg.steps), "--log-every", "10"]
    argv += ["--optim.warmup-steps", str(max(cfg.steps // 10, 1))]
    if cfg.depth is not None:
        argv += ["--model.depth", str(cfg.depth)]
    if cfg.tubelet is not None:
        argv += ["--model.tubelet", *map(str, cfg.tubelet)]
    return argv + extra


def single_rank_env() -> dict[str, str]:
    port = str(free_port())
    return dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def train(cfg: Config, store: Path, run: Path, extra: list[str], checkpoint_every: int) -> Row:
    start = time.perf_counter()
    result = subprocess.run(
        train_argv(cfg, store, run, extra, checkpoint_every), env=single_rank_env(), capture_output=True, text=True
    )
    if result.returncode:
        raise SystemExit(f"training {run.name} failed:\n{result.stderr[-3000:]}")
    records = RunDir(run).metrics()
    summary = next(r for r in reversed(records) if r["kind"] == "summary")
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    saved = [r for r in records if r["kind"] == "checkpoint" and r["step"] < cfg.steps]  # the mid-run one(s)
    if saved:
        summary = {**summary, "blocked_s": max(r["blocked_s"] for r in saved), "written_s": saved[0]["written_s"]}
    return Row(run.name.replace("-compiled", " compiled"), summary, losses, time.perf_counter() - start)


def kill_and_resume(cfg: Config, store: Path, run: Path, extra: list[str], half: int) -> dict[int, float]:
    """A run killed with SIGKILL once its step-``half`` checkpoint is complete, then restarted; its losses."""
    argv = train_argv(cfg, store, run, extra, half)
    proc = subprocess.Popen(argv, env=single_rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = RunDir(run).checkpoints
    while not checkpoints.is_complete(checkpoints.tag(half)):
        if proc.poll() is not None:
            raise SystemExit(f"the run to be killed ended first (exit {proc.returncode})")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    result = subprocess.run(argv, env=single_rank_env(), capture_output=True, text=True)
    if result.returncode or "resumed from checkpoint" not in result.stderr:
        raise SystemExit(f"the resumed run failed:\n{result.stderr[-3000:]}")
    records = RunDir(run).metrics()
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def evaluate(run: Path, workers: int) -> dict:
    argv = [sys.executable, "-m", "clipforge.jobs.evaluate", "--run", str(run), "--split", "val"]
    argv += ["--views.temporal", "2", "--views.spatial", "3", "--executor", "debug", "--workers", str(workers)]
    result = subprocess.run(argv, capture_output=True, text=True, env=single_rank_env())
    if result.returncode:
        raise SystemExit(f"evaluation failed:\n{result.stderr[-3000:]}")
    metrics = json.loads((run / "eval-val.json").read_text())  # its videos/s: timed by the job after start-up
    return {**metrics, "views_per_video": metrics["clips"] // max(metrics["videos"], 1)}


def jpeg_decode(store: Path, batch: int, rounds: int = 5) -> dict:
    """Frames/s of ``--data.decode device`` (nvJPEG on CUDA) against one CPU core, on the check's own clips."""
    from clipforge.preprocess.jpeg import decode_jpeg, decode_jpeg_batch, encode_jpeg
    from clipforge.preprocess.store import ClipStore

    source = ClipStore.open(store)
    clips = np.stack([source.read_clip(i) for i in range(min(batch, len(source)))])
    encoded = encode_jpeg(clips, 90)
    rows = [list(row) for row in encoded]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decode_jpeg_batch(rows, device)  # warm: the decoder's handles and buffers
    cpu_s, device_s = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        host = np.stack([decode_jpeg(row) for row in rows])
        cpu_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = decode_jpeg_batch(rows, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        device_s.append(time.perf_counter() - start)
    frames = clips.shape[0] * clips.shape[1]
    cpu_fps, device_fps = frames / float(np.median(cpu_s)), frames / float(np.median(device_s))
    difference = float(np.abs(decoded.cpu().numpy().astype(np.int16) - host.astype(np.int16)).mean())
    size = f"{clips.shape[2]}x{clips.shape[3]}"
    return {
        "frames": frames,
        "size": size,
        "device": device.type,
        "cpu_fps": cpu_fps,
        "device_fps": device_fps,
        "ratio": device_fps / cpu_fps,
        "difference": difference,
    }


def attention_kernel(cfg: Config) -> str:
    """Which fused SDPA kernel runs the model's attention shape at bf16 here: flash, memory-efficient or math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from clipforge.models.builders import architecture

    arch = architecture(
        cfg.model,
        6,
        cfg.frames,
        cfg.crop,
        **({"depth": cfg.depth} if cfg.depth else {}),
        **({"tubelet": cfg.tubelet} if cfg.tubelet else {}),
    )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = arch.build(seed=0).to(device)
    attention = next(m for m in model.modules() if type(m).__name__ == "Attention")
    embedding = next(m for m in model.modules() if type(m).__name__ == "Embedding")
    with torch.no_grad():
        x = embedding(torch.zeros(2, cfg.frames, cfg.crop, cfg.crop, 3, dtype=torch.uint8, device=device))
    x = x.to(torch.bfloat16)
    attention = attention.to(torch.bfloat16)
    shape = f"[{x.shape[0]}, {attention.heads}, {x.shape[1]}, {x.shape[2] // attention.heads}] bf16"
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.EFFICIENT_ATTENTION, "memory-efficient")):
        try:
            with sdpa_kernel(backend), torch.no_grad():
                attention(x)
            return f"{label} kernel runs q/k/v {shape} on {device.type}"
        except RuntimeError:
            continue
    return f"math (unfused) kernel only for q/k/v {shape} on {device.type}"


def table(rows: list[Row]) -> list[str]:
    memory = "peak GPU GiB" if torch.cuda.is_available() else "peak RSS GiB"
    lines = [
        f"| run | clips/s | TFLOP/s | MFU | data wait | {memory} | checkpoint blocked s / written s "
        "| loss first → last | wall s |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        f = r.figures
        steps = sorted(r.losses)
        mfu = f"{f['mfu']:.1%}" if "mfu" in f else "-"
        checkpoint = f"{f['blocked_s']:.3f} / {f['written_s']:.2f}" if "blocked_s" in f else "-"
        lines.append(
            f"| {r.name} | {f.get('clips_per_s', 0):.1f} | {f.get('tflops', 0):.2f} | {mfu} "
            f"| {f.get('data_wait', 0):.1%} "
            f"| {f['peak_memory_gib']:.2f} | {checkpoint} "
            f"| {r.losses[steps[0]]:.3f} → {r.losses[steps[-1]]:.3f} | {r.seconds:.0f} |"
        )
    if rows and "peak_tflops" in rows[0].figures:
        f = rows[0].figures
        lines.append(
            f"\nMFU against {f['peak_tflops']:.1f} TFLOP/s ({f['peak_source']}) of {f['device']}; "
            "figures without each run's first step; the steady rate includes the mid-run checkpoint's blocking."
        )
    return lines


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
