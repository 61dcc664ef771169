#!/usr/bin/env python3
"""Benchmark of the preprocess room: every figure beside its limit or peer, measured in one run.

    python jobs/bench/preprocess.py [--videos N] [--work-dir DIR]

On the same videos it measures:

* bare PyAV seek + decode + resize, one process: the limit for packing;
* a plain forward decode of each whole file taking frames by number, without
  clipforge's timing checks: the peer that says what the checks cost;
* clipforge's decoding (one forward decode, timing decided per video);
* packing with 1 and 2 MPI ranks (ratio to the limit, parallel efficiency);
* reading clips from the store with the training reader, in random order,
  against decoding the same clips from the video files on the fly, seeking to
  each as SlowFast's and VideoMAE's loaders do.

The sides are measured in turn, ``--repeats`` times; each figure is the median
over the repeats and each ratio the median of the paired ratios, with their
min-max. Absolute rates depend on the machine; the ratios are the result.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import av.video.reformatter
import numpy as np
import tyro

from clipforge.hpc.mpi import mpiexec_command
from clipforge.preprocess import synthetic
from clipforge.preprocess.decode import ClipParams, decode_clips
from clipforge.preprocess.reader import ClipDataset


@dataclasses.dataclass
class Config:
    """Measure packing and reading throughput against bare decoding."""

    videos: int = 36
    """Synthetic videos to make (640x360, 6 s, H.264)."""
    work_dir: Path | None = None
    """Where the corpus and stores go (default: a temporary directory, removed afterwards)."""
    reads: int = 2000
    """Random clip reads for the reader figure."""
    repeats: int = 5
    """Rounds of every measurement, taken in turn (the machines are noisy)."""


PARAMS = ClipParams(clip_frames=16, frame_stride=2, height=112, width=112, clips_per_video=4)


def bare_decode(paths: list[Path], params: ClipParams) -> int:
    """The limit: PyAV alone seeking to each clip, decoding forward and resizing, no store and no checks.

    Same geometry as the store (short side to 112, centre crop), so only the work around decoding differs.
    """
    clips = 0
    reformatter = av.video.reformatter.VideoReformatter()
    for path in paths:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate)
            duration = float(stream.duration * stream.time_base)
            span = params.clip_frames * params.frame_stride / fps
            for k in range(params.clips_per_video):
                seek_clip(container, (duration - span) * k / (params.clips_per_video - 1), params, reformatter)
                clips += 1
    return clips


def seek_clip(container, start: float, params: ClipParams, reformatter) -> None:
    """Seek to the keyframe before ``start``, decode forward, take every stride-th frame from ``start`` on."""
    stream = container.streams.video[0]
    container.seek(int(start / stream.time_base), stream=stream)
    taken = 0
    for i, frame in enumerate(f for f in container.decode(stream) if f.time >= start - 1e-6):
        if i % params.frame_stride == 0:
            scale = max(params.width / frame.width, params.height / frame.height)
            w, h = round(frame.width * scale), round(frame.height * scale)
            img = reformatter.reformat(frame, width=w, height=h, format="rgb24", threads=1).to_ndarray()
            img[(h - params.height) // 2 :][: params.height, (w - params.width) // 2 :][:, : params.width].copy()
            taken += 1
            if taken == params.clip_frames:
                break


def forward_decode(paths: list[Path], params: ClipParams) -> int:
    """The peer of the timing checks: decode each whole file forward, take frames by number, resize them.

    What a loader indexing by frame number does (decord, VideoMAE-style loaders), and what
    clipforge's decoding does less its timing checks: the difference is what the checks cost.
    """
    clips = 0
    reformatter = av.video.reformatter.VideoReformatter()
    span = params.clip_frames * params.frame_stride
    for path in paths:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            count = stream.frames
            starts = [round((count - span) * k / (params.clips_per_video - 1)) for k in range(params.clips_per_video)]
            wanted = {s + i * params.frame_stride for s in starts for i in range(params.clip_frames)}
            for n, frame in enumerate(container.decode(stream)):
                if n in wanted:
                    scale = max(params.width / frame.width, params.height / frame.height)
                    w, h = round(frame.width * scale), round(frame.height * scale)
                    img = reformatter.reformat(frame, width=w, height=h, format="rgb24", threads=1).to_ndarray()
                    img[(h - params.height) // 2 :][: params.height, (w - params.width) // 2 :][
                        :, : params.width
                    ].copy()
            clips += len(starts)
    return clips


def timed(work, *args) -> float:
    """Items per second of ``work(*args)``, which returns how many items it did."""
    start = time.perf_counter()
    done = work(*args)
    return done / (time.perf_counter() - start)


def read_clips(dataset: ClipDataset, order: np.ndarray) -> int:
    for i in order:
        dataset[int(i)]
    return len(order)


def decode_on_the_fly(dataset: ClipDataset, picks: np.ndarray, corpus: Path) -> int:
    """The same clips decoded from the video files by seeking to each, as SlowFast's and VideoMAE's loaders do."""
    store = dataset.store
    reformatter = av.video.reformatter.VideoReformatter()
    for i in picks:
        position = int(dataset.positions[int(i)])
        video = store.videos["path"][store.video_ids[position]]
        with av.open(str(corpus / video)) as container:
            seek_clip(container, float(store.start_times[position]), PARAMS, reformatter)
    return len(picks)


def clipforge_decode(paths: list[Path], params: ClipParams) -> int:
    return sum(len(decode_clips(p, params).clips) for p in paths)


def pack_rate(corpus: Path, out: Path, ranks: int) -> float:
    """clips/s that the packing job reports for itself (MPI start-up excluded)."""
    argv = [
        *mpiexec_command(ranks),
        sys.executable,
        "-m",
        "clipforge.jobs.preprocess",
        "--videos",
        str(corpus),
        "--out",
        str(out),
        "--clip-frames",
        str(PARAMS.clip_frames),
        "--frame-stride",
        str(PARAMS.frame_stride),
        "--height",
        str(PARAMS.height),
        "--width",
        str(PARAMS.width),
        "--clips-per-video",
        str(PARAMS.clips_per_video),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    match = re.search(r"\(([\d.]+) clips/s\)", result.stderr)
    assert match, result.stderr[-2000:]
    return float(match.group(1))


def main(cfg: Config) -> None:
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="clipforge-bench-"))
    try:
        corpus = work / "corpus"
        if not corpus.exists():
            rng = np.random.default_rng(0)
            for i in range(cfg.videos):
                label = synthetic.CLASSES[i % len(synthetic.CLASSES)]
                spec = synthetic.VideoSpec(
                    label, frames=150, fps=25, width=640, height=360, gop=25, seed=int(rng.integers(1 << 30))
                )
                synthetic.write_video(corpus / label / f"{i:03d}.mp4", spec)
        paths = sorted(corpus.rglob("*.mp4"))

        runs: dict[str, list[float]] = {k: [] for k in ("limit", "forward", "ours", "one", "two", "reader", "fly")}
        dataset = None
        for round_ in range(cfg.repeats):
            runs["limit"].append(timed(bare_decode, paths, PARAMS))
            runs["forward"].append(timed(forward_decode, paths, PARAMS))
            runs["ours"].append(timed(clipforge_decode, paths, PARAMS))
            for ranks, key in ((1, "one"), (2, "two")):
                store = work / f"store{ranks}"
                shutil.rmtree(store, ignore_errors=True)
                runs[key].append(pack_rate(corpus, store, ranks))
            first = dataset is None
            dataset = ClipDataset(work / "store2", "train")  # the store was packed again this round
            if first:
                order = np.random.default_rng(0).integers(0, len(dataset), cfg.reads)
            read_clips(dataset, order[:200])  # warm the page cache and the handles, as an epoch after the first would
            runs["reader"].append(timed(read_clips, dataset, order))
            runs["fly"].append(timed(decode_on_the_fly, dataset, order[:40], corpus))
            print(f"round {round_ + 1}/{cfg.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()))

        def figure(key: str) -> float:
            return statistics.median(runs[key])

        def ratio(key: str, peer: str, per: float = 1.0) -> tuple[float, float, float]:
            paired = [a / (b * per) for a, b in zip(runs[key], runs[peer])]
            return statistics.median(paired), min(paired), max(paired)

        rows = [
            ("bare PyAV seek+decode+resize (limit)", "limit", "", ""),
            ("forward decode by frame number (peer)", "forward", "", ""),
            ("clipforge decode_clips, 1 process", "ours", "forward", ">= 0.95x"),
            ("pack, 1 MPI rank", "one", "limit", ">= 0.9x"),
            ("pack, 2 MPI ranks", "two", "one", ">= 1.8x"),
            ("reader, random clips from the store", "reader", "fly", ">= 50x"),
            ("on-the-fly decode of the same clips (peer)", "fly", "", ""),
        ]
        print(
            f"\n{len(paths)} videos of 640x360, 6 s; clips of {PARAMS.clip_frames} frames, stride "
            f"{PARAMS.frame_stride}, {PARAMS.height}x{PARAMS.width}, {PARAMS.clips_per_video} per video; "
            f"medians of {cfg.repeats} alternating rounds\n"
        )
        print(f"{'figure':<44} {'clips/s':>9}  {'vs':<8} {'ratio':>7} {'min-max':>12}  goal")
        for name, key, peer, goal in rows:
            text = ""
            if peer:
                mid, lo, hi = ratio(key, peer)
                text = f"{mid:6.2f}x {lo:5.2f}-{hi:.2f}x"
            print(f"{name:<44} {figure(key):9.1f}  {peer:<8} {text:>20}  {goal}")
        mid, lo, hi = ratio("two", "one", 2.0)
        print(f"\nparallel efficiency of 2 ranks: {mid:.0%} ({lo:.0%}-{hi:.0%})")
        mid, lo, hi = ratio("ours", "forward")
        print(
            f"cost of the timing checks: {100 * (1 - mid):.1f}% of decoding throughput "
            f"({100 * (1 - hi):.1f} to {100 * (1 - lo):.1f}%)"
        )
    finally:
        if cfg.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
