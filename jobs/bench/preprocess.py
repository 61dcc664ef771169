#!/usr/bin/env python3
"""Benchmark of the preprocess room: every figure beside its limit or peer, measured in one run.

    python jobs/bench/preprocess.py [--videos N] [--work-dir DIR]

On the same videos it measures:

* bare PyAV seek + decode + resize, one process: the limit for packing;
* packing with 1 and 2 MPI ranks (ratio to the limit, parallel efficiency);
* reading clips from the store with the training reader, in random order,
  against decoding the same clips from the video files on the fly.

Absolute rates depend on the machine; the ratios are the result.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
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
from clipforge.preprocess.decode import ClipParams, decode_clip, decode_clips
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
                start = (duration - span) * k / (params.clips_per_video - 1)
                container.seek(int(start / stream.time_base), stream=stream)
                taken = 0
                for i, frame in enumerate(f for f in container.decode(stream) if f.time >= start - 1e-6):
                    if i % params.frame_stride == 0:
                        scale = max(params.width / frame.width, params.height / frame.height)
                        w, h = round(frame.width * scale), round(frame.height * scale)
                        img = reformatter.reformat(frame, width=w, height=h, format="rgb24", threads=1).to_ndarray()
                        img[(h - params.height) // 2 :][: params.height, (w - params.width) // 2 :][
                            :, : params.width
                        ].copy()
                        taken += 1
                        if taken == params.clip_frames:
                            break
                clips += 1
    return clips


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

        start = time.perf_counter()
        limit = bare_decode(paths, PARAMS) / (time.perf_counter() - start)
        ours_start = time.perf_counter()
        ours = sum(len(decode_clips(p, PARAMS).clips) for p in paths) / (time.perf_counter() - ours_start)

        one = pack_rate(corpus, work / "store1", 1)
        two = pack_rate(corpus, work / "store2", 2)

        dataset = ClipDataset(work / "store2", "train")
        order = np.random.default_rng(0).integers(0, len(dataset), cfg.reads)
        for i in order[:200]:
            dataset[int(i)]  # warm the page cache and the handles, as an epoch after the first would be
        start = time.perf_counter()
        for i in order:
            dataset[int(i)]
        reader = cfg.reads / (time.perf_counter() - start)

        store = dataset.store
        picks = order[:40]
        start = time.perf_counter()
        for i in picks:
            position = int(dataset.positions[int(i)])
            video = store.videos["path"][store.video_ids[position]]
            decode_clip(corpus / video, PARAMS, float(store.start_times[position]))
        on_the_fly = len(picks) / (time.perf_counter() - start)

        rows = [
            ("bare PyAV seek+decode+resize (limit)", limit, "", None, ""),
            ("clipforge decode_clips, 1 process", ours, "limit", ours / limit, ""),
            ("pack, 1 MPI rank", one, "limit", one / limit, ">= 0.9x"),
            ("pack, 2 MPI ranks", two, "1 rank", two / one, ">= 1.8x"),
            ("reader, random clips from the store", reader, "on-the-fly", reader / on_the_fly, ">= 50x"),
            ("on-the-fly decode of the same clips (peer)", on_the_fly, "", None, ""),
        ]
        print(
            f"\n{len(paths)} videos of 640x360, 6 s; clips of {PARAMS.clip_frames} frames, stride "
            f"{PARAMS.frame_stride}, "
            f"{PARAMS.height}x{PARAMS.width}, {PARAMS.clips_per_video} per video\n"
        )
        print(f"{'figure':<44} {'clips/s':>9}  {'vs':<11} {'ratio':>7}  goal")
        for name, rate, peer, ratio, goal in rows:
            ratio_text = f"{ratio:6.2f}x" if ratio is not None else ""
            print(f"{name:<44} {rate:9.1f}  {peer:<11} {ratio_text:>7}  {goal}")
        print(f"\nparallel efficiency of 2 ranks: {two / (2 * one):.0%}")
    finally:
        if cfg.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
