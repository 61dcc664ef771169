#!/usr/bin/env python3
"""Benchmark of the clip store at scale, and of its codecs: figures beside their peers, measured in one run.

    python jobs/bench/store.py [--shards 10 1000 10000] [--repeats 5]

Scale, per training rank, for stores of 10, 1,000 and 10,000 one-video shards:

* time and ``openat`` calls (counted by strace where it is installed) to open the store;
* peak open file descriptors during a random pass over every clip under ``ulimit -n 256``;
* reader clips/s in that pass.

Codecs, at 16x224x224 on camera footage (the sample videos when present, else
synthetic video): bytes per clip and clips/s per core for ``raw`` and ``jpeg``
(libjpeg-turbo through simplejpeg, and Pillow as the peer), beside on-the-fly
PyAV decoding of the same clips; and the CPU cores an H200 needs to train
VideoViT-B at 45% MFU from a ``jpeg`` store.

Locality, on a cold page cache (every shard's pages dropped with
``posix_fadvise(DONTNEED)`` before each pass): one training rank's half of an
epoch over 200 shards of 20 clips of 16x112x112, sampled by a global shuffle
(the peer) and by ``--data.shuffle shards`` (windows of 256 clips): clips/s and
shard opens per 1,000 clips with the reader's 64 handles.

Each figure is the median over ``--repeats`` alternating rounds; each ratio the
median of the paired ratios, with their min-max.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tyro

from clipforge.hpc.accelerator import DATASHEET_BF16_TFLOPS
from clipforge.preprocess import synthetic
from clipforge.preprocess.decode import ClipParams, decode_clips

SAMPLES = Path(__file__).resolve().parents[2] / ".cache" / "sample-videos"
CLIP = ClipParams(clip_frames=16, frame_stride=2, clips_per_video=4, height=224, width=224)

OPEN = (
    "import sys, time; from clipforge.preprocess.store import ClipStore; t = time.perf_counter(); "
    "s = ClipStore.open(sys.argv[1]); print(time.perf_counter() - t, len(s))"
)

PASS = """
import os, resource, sys, time
import numpy as np
from clipforge.preprocess.reader import ClipDataset
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
data = ClipDataset(sys.argv[1], "train")
peak, start = 0, time.perf_counter()
for n, i in enumerate(np.random.default_rng(0).permutation(len(data))):
    data[int(i)]
    if n % 100 == 0:
        peak = max(peak, len(os.listdir("/proc/self/fd")))
print(len(data) / (time.perf_counter() - start), peak)
"""


@dataclasses.dataclass
class Config:
    """Measure opening and reading stores of many shards, and the codecs' size and speed."""

    shards: tuple[int, ...] = (10, 1000, 10000)
    """Store sizes, in one-video shards."""
    repeats: int = 5
    """Alternating rounds of every measurement."""
    work_dir: Path | None = None
    """Where the stores go (default: a temporary directory, removed afterwards)."""


def open_figures(store: Path) -> tuple[float, int | None]:
    """(seconds to open, openat calls) in a fresh process; openat is None without strace."""
    result = subprocess.run([sys.executable, "-c", OPEN, str(store)], capture_output=True, text=True, check=True)
    seconds = float(result.stdout.split()[0])
    if not shutil.which("strace"):
        return seconds, None
    base = subprocess.run(
        ["strace", "-f", "-c", "-e", "trace=openat", sys.executable, "-c", OPEN.replace("ClipStore.open", "str")]
        + [str(store)],
        capture_output=True,
        text=True,
    )
    traced = subprocess.run(
        ["strace", "-f", "-c", "-e", "trace=openat", sys.executable, "-c", OPEN, str(store)],
        capture_output=True,
        text=True,
    )
    return seconds, _calls(traced.stderr) - _calls(base.stderr)  # the opens of opening the store alone


def _calls(strace_summary: str) -> int:
    match = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)(?:\s+\d+)?\s+openat$", strace_summary, re.MULTILINE)
    return int(match.group(1)) if match else 0


def random_pass(store: Path) -> tuple[float, int]:
    result = subprocess.run([sys.executable, "-c", PASS, str(store)], capture_output=True, text=True, check=True)
    rate, peak = result.stdout.split()
    return float(rate), int(peak)


def footage(work: Path) -> list[Path]:
    videos = sorted(SAMPLES.glob("*.mp4"))
    if videos:
        return videos
    spec = synthetic.VideoSpec("move_right", frames=150, width=640, height=360, seed=1)
    return [synthetic.write_video(work / "footage.mp4", spec)]


def pillow_decode(frames) -> np.ndarray:
    """The peer: the reader as it was, one Pillow decode per frame."""
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(np.asarray(f).tobytes())).convert("RGB")) for f in frames])


def write_clip_store(out: Path, clips: np.ndarray, codec: str):
    """One shard holding ``clips`` in ``codec``, indexed and opened like any store."""
    from clipforge.preprocess.store import ClipStore
    from clipforge.preprocess.store_writer import ShardWriter, write_index, write_params

    params = {**dataclasses.asdict(CLIP), "codec": codec, "jpeg_quality": 90}
    write_params(out, params, overwrite=True)
    writer = ShardWriter(out, 0, clips.shape[1:4], codec, 90)
    info = {"fps": 25.0, "duration": 1.0, "frames": 25, "status": "ok", "timing": "pts", "promised_frames": 25}
    info |= {"first_time": 0.0, "last_time": 0.96, "repeated_clips": 0}
    writer.add_video(0, 0, clips, [0.0] * len(clips), info)
    video = {"path": "footage", "label": 0, "split": "train", "num_clips": len(clips), **info}
    write_index(out, [video], ["footage"], params, [writer.commit()])
    return ClipStore.open(out)


def read_clips(store, count: int) -> int:
    for i in range(count):
        store.read_clip(i)
    return count


def on_the_fly(starts: list[tuple[Path, float]]) -> int:
    """The peer of reading a store: seek to each clip in its video and decode it, as SlowFast's loader does."""
    import av
    import av.video.reformatter

    from clipforge.jobs.bench.preprocess import seek_clip

    reformatter = av.video.reformatter.VideoReformatter()
    for video, start in starts:
        with av.open(str(video)) as container:
            seek_clip(container, start, CLIP, reformatter)
    return len(starts)


def per_second(work, items: int) -> float:
    start = time.perf_counter()
    work()
    return items / (time.perf_counter() - start)


def drop_cache(store: Path) -> None:
    """Evict the store's shards from the page cache, as after a reboot or another job's reads."""
    for path in (store / "shards").glob("*.h5"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sampled_pass(store: Path, shuffle: str, window: int = 256) -> tuple[float, float]:
    """(clips/s, shard opens per 1,000 clips) of rank 0 of 2 through one epoch, from a cold page cache."""
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.train.sampler import StepSampler

    data = ClipDataset(store, "train")
    local = shuffle == "shards"
    sampler = StepSampler(
        data.labels,
        8,
        1,
        0,
        2,
        seed=0,
        balanced=False,
        shards=data.shards if local else None,
        positions=data.positions if local else None,
        window=window if local else 0,
    )
    drop_cache(store)
    steps = len(data) // 16
    start = time.perf_counter()
    for batch in sampler.batches(0, steps):
        for i in batch:
            data[i]
    seconds = time.perf_counter() - start
    return steps * 8 / seconds, 1000 * data.store.opened / (steps * 8)


def main(cfg: Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # per core
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="clipforge-bench-store-"))
    try:
        stores = {}
        for n in cfg.shards:
            start = time.perf_counter()
            stores[n] = synthetic.write_sharded_store(work / f"store-{n}", n)
            print(f"wrote a store of {n} shards in {time.perf_counter() - start:.1f} s", flush=True)
        scale: dict[int, dict[str, list[float]]] = {n: {"open_s": [], "reads": [], "fds": []} for n in cfg.shards}
        opens: dict[int, int | None] = {}
        for round_ in range(cfg.repeats):
            for n, store in stores.items():
                seconds, calls = open_figures(store) if round_ == 0 else (open_figures(store)[0], None)
                opens.setdefault(n, calls)
                rate, peak = random_pass(store)
                scale[n]["open_s"].append(seconds)
                scale[n]["reads"].append(rate)
                scale[n]["fds"].append(peak)

        local_store = synthetic.write_sharded_store(work / "locality", 200, 16, 112, videos_per_shard=20)
        locality: dict[str, list[tuple[float, float]]] = {"global": [], "shards": []}
        for _ in range(cfg.repeats):
            for shuffle in ("global", "shards"):
                locality[shuffle].append(sampled_pass(local_store, shuffle))
        shutil.rmtree(local_store)

        videos = footage(work)
        decoded = {v: decode_clips(v, CLIP) for v in videos}
        clips = np.concatenate([d.clips for d in decoded.values()])
        starts = [(v, s) for v, d in decoded.items() for s in d.starts]
        stores = {c: write_clip_store(work / f"codec-{c}", clips, c) for c in ("raw", "jpeg")}
        raw_bytes = int(stores["raw"].shard_disk.sum()) / len(clips)
        jpeg_bytes = int(stores["jpeg"].shard_disk.sum()) / len(clips)
        jpeg_rows = stores["jpeg"]._shard(0)["clips"]
        read_clips(stores["jpeg"], len(clips))  # warm: imports, handles, the page cache
        codec: dict[str, list[float]] = {"raw": [], "turbo": [], "pillow": [], "fly": []}
        for _ in range(cfg.repeats):
            codec["raw"].append(per_second(lambda: read_clips(stores["raw"], len(clips)), len(clips)))
            codec["turbo"].append(per_second(lambda: read_clips(stores["jpeg"], len(clips)), len(clips)))
            codec["pillow"].append(per_second(lambda: [pillow_decode(row) for row in jpeg_rows], len(clips)))
            codec["fly"].append(per_second(lambda: on_the_fly(starts), len(starts)))

        print(f"\nscale: one-video shards of 2x8x8 clips, per training rank; medians of {cfg.repeats} rounds\n")
        print(f"{'shards':>7} {'open (s)':>9} {'openat':>7} {'peak fds':>9} {'reads/s':>9}   (ulimit -n 256)")
        for n in cfg.shards:
            calls = "n/a" if opens[n] is None else str(opens[n])
            f = {k: statistics.median(v) for k, v in scale[n].items()}
            print(f"{n:>7} {f['open_s']:9.3f} {calls:>7} {f['fds']:9.0f} {f['reads']:9.0f}")

        def ratio(a: str, b: str) -> str:
            paired = [x / y for x, y in zip(codec[a], codec[b])]
            return f"{statistics.median(paired):6.2f}x {min(paired):5.2f}-{max(paired):.2f}x"

        paired = [b[0] / a[0] for a, b in zip(locality["global"], locality["shards"])]
        print("\nlocality: 200 shards x 20 clips of 16x112x112, one rank of 2, cold page cache, 64 handles\n")
        print(f"{'sampling':<34} {'clips/s':>9} {'opens/1k clips':>15}")
        for name, key in (("global shuffle (peer)", "global"), ("shards, windows of 256 clips", "shards")):
            rate = statistics.median(r for r, _ in locality[key])
            print(f"{name:<34} {rate:9.0f} {statistics.median(o for _, o in locality[key]):15.0f}")
        print(
            f"shards / global: {statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f}x) "
            f"over {cfg.repeats} paired rounds"
        )

        print(f"\ncodecs: {len(clips)} clips of 16x224x224 from {', '.join(v.name for v in videos)}, one core\n")
        print(f"{'codec':<36} {'bytes/clip':>11} {'clips/s':>9}  {'vs':<9} {'ratio':>7} {'min-max':>12}")
        rows = (
            ("raw", "raw", raw_bytes, "turbo"),
            ("jpeg, libjpeg-turbo (simplejpeg)", "turbo", jpeg_bytes, "pillow"),
            ("jpeg, Pillow (peer)", "pillow", jpeg_bytes, ""),
        )
        for name, key, size, peer in rows:
            text = ratio(key, peer) if peer else ""
            print(f"{name:<36} {size:>11,.0f} {statistics.median(codec[key]):9.1f}  {peer:<9} {text:>20}")
        fly = statistics.median(codec["fly"])
        print(f"{'on-the-fly PyAV seek+decode (peer)':<36} {'':>11} {fly:9.1f}")
        against_fly = ratio("turbo", "fly").split()[0]
        print(f"\njpeg is {raw_bytes / jpeg_bytes:.1f}x smaller than raw and reads {against_fly} on-the-fly decoding")
        from clipforge.models.builders import architecture

        flops = 3 * architecture("videovit-base", 400).flops()  # forward and backward
        need = DATASHEET_BF16_TFLOPS["H200"] * 1e12 * 0.45 / flops
        cores = math.ceil(need / statistics.median(codec["turbo"]))
        print(
            f"VideoViT-B at 45% MFU on an H200: {flops / 1e12:.2f} TFLOP per clip, {need:.0f} clips/s, "
            f"so {cores} CPU cores decoding jpeg (or nvJPEG on the GPU)"
        )
    finally:
        if cfg.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(tyro.cli(Config))
