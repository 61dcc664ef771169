#!/usr/bin/env python3
"""Every room's benchmark in one run, written to BENCHMARKS.md with the machine it ran on.

    python jobs/bench/all.py [--out BENCHMARKS.md]

Runs, in order: the preprocess room (bare PyAV decode as the limit, packing with
1 and 2 ranks, the reader against on-the-fly decoding as SlowFast's and
VideoMAE's loaders do), training (plain DDP against DeepSpeed's ZeRO stages,
model-state bytes against the ZeRO paper), the store (10 to 10,000 shards,
locality, codecs), the training loop (the Trainer beside a bare loop of its own
model), the registry (push and pull against their floor and plain
git with git-lfs, list at 1,000 versions), the parameter server (sync against
SSP and async with a straggler), federated training (Flower's FedAvg, bf16
updates, SecAgg+ and DP per round, accuracy under a privacy budget), pretraining (masked
autoencoding's clips/s beside fine-tuning's, and fine-tuning with a tenth of the labels from it
against from scratch) and the nodes (one node against three on the
multi-node cluster, and the time from a node's loss to resumed training).
Each prints its own table with ratios; this job collects them.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import tyro

BENCHMARKS = [
    ("Preprocess: packing and reading clips", "clipforge.jobs.bench.preprocess", []),
    ("Store: 10 to 10,000 shards, and its codecs", "clipforge.jobs.bench.store", []),
    ("Training: DDP against DeepSpeed ZeRO 0-3", "clipforge.jobs.bench.train", []),
    ("Training loop: the Trainer beside a bare loop of its own model", "clipforge.jobs.bench.loop", []),
    ("Registry: push, pull, list", "clipforge.jobs.bench.registry", []),
    ("Parameter server: sync, SSP, async with a straggler", "clipforge.jobs.bench.ps", []),
    ("Federated training on Flower: FedAvg, bf16, SecAgg+, DP; accuracy at a budget", "clipforge.jobs.bench.fl", []),
    (
        "Federated aggregation rules: FedAvg, trimmed mean, median, Krum",
        "clipforge.jobs.bench.fl",
        ["--parts", "robust", "--robust-rounds", "3", "--accuracy-videos-per-class", "10"],
    ),
    ("Pretraining: masked autoencoding beside fine-tuning, and few labels", "clipforge.jobs.bench.pretrain", []),
    ("Nodes: one node against three, and a node lost", "clipforge.jobs.bench.nodes", []),
]


@dataclasses.dataclass
class Config:
    """Run every benchmark and write BENCHMARKS.md."""

    out: Path = Path("BENCHMARKS.md")
    """Where the report goes."""
    gpu: bool = False
    """On a machine with accelerators: also train VideoViT-B at bf16 (16x224x224) on every GPU and report MFU."""
    only: str | None = None
    """Run only the section whose title starts with this, and replace that section in --out (the rest is kept)."""


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        (
            int(line.split()[1]) // 1024**2
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem} GiB; accelerator: {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def main(cfg: Config) -> None:
    sections = [
        "# clipforge benchmarks",
        "",
        f"Made by `python jobs/bench/all.py` on {time.strftime('%Y-%m-%d')}.",
        f"Machine: {machine()}.",
        "",
        "Every figure sits beside its limit or its peer, measured in the same run; the ratios are the result,",
        "absolute times move with the machine.",
        "",
    ]
    benchmarks = list(BENCHMARKS)
    if cfg.only is not None:
        benchmarks = [b for b in BENCHMARKS if b[0].startswith(cfg.only)]
        if len(benchmarks) != 1:
            raise SystemExit(f"bench_all: --only {cfg.only!r} names {len(benchmarks)} sections; give a title's start")
    if cfg.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("bench_all: --gpu needs a CUDA device, and torch sees none")
        gpus = str(torch.cuda.device_count())
        benchmarks.append(
            (
                "GPU: VideoViT-B at bf16, ZeRO 0-3, MFU",
                "clipforge.jobs.bench.train",
                ["--model", "videovit-base", "--frames", "16", "--size", "224", "--batch", "8", "--ranks", gpus],
            )
        )
        benchmarks.append(
            ("GPU: the Trainer beside a bare loop, VideoViT-B", "clipforge.jobs.bench.loop", ["--gpu", "--rounds", "3"])
        )
        benchmarks.append(
            ("GPU check: the Trainer at ZeRO 0, 2, 3, resume, evaluation", "clipforge.jobs.gpu_check", [])
        )
    for title, module, args in benchmarks:
        print(f"==> {title}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
        body = (
            result.stdout.strip()
            if result.returncode == 0
            else f"FAILED (exit {result.returncode}):\n{result.stderr.strip()[-2000:]}"
        )
        sections += [
            f"## {title}",
            "",
            f"`python -m {module}` ({time.perf_counter() - started:.0f} s)",
            "",
            "```",
            body,
            "```",
            "",
        ]
        print(body, flush=True)
    if cfg.only is not None:
        cfg.out.write_text(replace_section(cfg.out.read_text() if cfg.out.exists() else "", sections[8:]))
        print(f"\nwritten to {cfg.out}", file=sys.stderr)
        return
    if not cfg.gpu:
        sections += [
            "## GPU",
            "",
            "Not measured: this machine has no accelerator. On a GPU node, `python jobs/bench/all.py --gpu` adds",
            "VideoViT-B at bf16 (MFU per ZeRO stage), the Trainer beside a bare loop on the GPU and the device",
            "check (`python jobs/gpu_check.py`).",
            "",
        ]
    cfg.out.write_text("\n".join(sections))
    print(f"\nwritten to {cfg.out}", file=sys.stderr)


def replace_section(report: str, section: list[str]) -> str:
    """``report`` with the section of the same ``## title`` as ``section`` replaced by it (appended if new)."""
    title = section[0]
    lines = report.splitlines()
    if title not in lines:
        return "\n".join([*lines, "", *section]) if lines else "\n".join(section)
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], *section, *lines[end:]])


if __name__ == "__main__":
    main(tyro.cli(Config))
