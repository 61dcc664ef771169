"""The clip store at the shapes users reach: many shards, low descriptor limits, one writer at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clipforge.hpc.lock import LOCK_NAME
from clipforge.preprocess import synthetic
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.preprocess.store_format import StoreError
from clipforge.train.sampler import StepSampler

from .helpers import pack_argv

pytestmark = pytest.mark.waits

SHARDS = 600  # over twice the descriptor limit below


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write_sharded_store(tmp_path_factory.mktemp("many") / "store", SHARDS)


def test_opening_reads_the_index_alone(many_shards: Path, tmp_path: Path) -> None:
    # With every shard moved away the store still opens, whole: nothing but index.h5 was read.
    away = tmp_path / "shards-away"
    (many_shards / "shards").rename(away)
    try:
        store = ClipStore.open(many_shards)
        assert len(store) == SHARDS and len(store.shard_names) == SHARDS
        assert store.labels.tolist() == [n % len(synthetic.CLASSES) for n in range(SHARDS)]
        with pytest.raises(StoreError, match="shard-00007.h5 is missing"):
            store.read_clip(7)  # a shard is looked at when first read
        with pytest.raises(StoreError, match="is missing"):
            store.verify()
    finally:
        away.rename(many_shards / "shards")


READ_EVERY_CLIP = """
import os, resource, sys
import numpy as np
from clipforge.preprocess.reader import ClipDataset
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
data = ClipDataset(sys.argv[1], "train")
peak = 0
for n, i in enumerate(np.random.default_rng(0).permutation(len(data))):
    clip, label = data[int(i)]
    assert clip.shape[0] == 2
    if n % 50 == 0:
        peak = max(peak, len(os.listdir("/proc/self/fd")))
print(len(data), peak)
"""


def test_a_random_pass_under_ulimit_256_reads_every_clip_of_600_shards(many_shards: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", READ_EVERY_CLIP, str(many_shards)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    read, peak = map(int, result.stdout.split())
    assert read == SHARDS and peak < 256, (read, peak)


def test_shards_have_no_holes(clean_store: Path) -> None:
    shards = list((clean_store / "shards").glob("*.h5"))
    apparent = sum(p.stat().st_size for p in shards)
    disk = sum(p.stat().st_blocks * 512 for p in shards)
    assert abs(disk - apparent) <= 0.05 * apparent + 4096 * len(shards), (disk, apparent)
    store = ClipStore.open(clean_store)
    assert int(store.shard_disk.sum()) == disk


@pytest.mark.mpi
def test_a_second_packing_job_on_a_store_is_refused_in_one_line(corpus: Path, tmp_path: Path, mpiexec) -> None:
    out = tmp_path / "store"
    argv = pack_argv(mpiexec, 1, corpus, out, clip_frames=8, height=32, width=32, clips_per_video=3)
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first job never took the lock"
            time.sleep(0.01)
        holder = json.loads((out / LOCK_NAME).read_text())["pid"]
        os.kill(holder, signal.SIGSTOP)  # the first job holds the store for as long as the second takes
        try:
            second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        finally:
            os.kill(holder, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-2000:]
        line = [x for x in second.stderr.splitlines() if "clipforge: error" in x]
        assert len(line) == 1 and "being written by process" in line[0] and "Traceback" not in second.stderr, (
            second.stderr[-2000:]
        )
    finally:
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert not (out / LOCK_NAME).exists()  # released at the end
    assert ClipStore.open(out).labels.size > 0


def test_a_lock_left_by_a_killed_writer_does_not_block_the_next(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from clipforge.hpc.lock import WriterLock; "
            "WriterLock(sys.argv[1], 'clip store').acquire(); print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    from clipforge.hpc.lock import WriterBusy, WriterLock

    with pytest.raises(WriterBusy, match=f"being written by process {holder.pid}"):
        WriterLock(tmp_path, "clip store").acquire()
    holder.kill()
    holder.wait()
    with WriterLock(tmp_path, "clip store"):  # its process is gone: the lock is taken over
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.fixture(scope="module")
def runs_of_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 shards of 20 one-clip videos: the shape of a store written by ranks of many videos each."""
    return synthetic.write_sharded_store(tmp_path_factory.mktemp("runs") / "store", 100, videos_per_shard=20)


def samplers(data: ClipDataset, **extra) -> tuple[StepSampler, StepSampler]:
    """A global shuffle and a locality-aware one over ``data``, 2 data-parallel ranks of 8 clips."""
    plain = StepSampler(data.labels, 8, 1, 0, 2, seed=3, balanced=False)
    local = StepSampler(
        data.labels, 8, 1, 0, 2, seed=3, balanced=False, shards=data.shards, positions=data.positions, window=40
    )
    return plain, local


def test_locality_aware_sampling_sees_every_clip_once_an_epoch_and_depends_on_seed_and_step_alone(
    runs_of_shards: Path,
) -> None:
    data = ClipDataset(runs_of_shards, "train")
    _, local = samplers(data)
    for epoch in (0, 1):
        assert sorted(local._epoch(epoch).tolist()) == list(range(len(data)))
    assert local._epoch(0).tolist() != local._epoch(1).tolist()
    # Resuming at step 37 computes the same clips as a run that got there from step 0.
    through = list(local.batches(0, 60))[37:]
    _, fresh = samplers(data)
    assert list(fresh.batches(37, 60)) == through
    # A window of 40 neighbouring clips spans at most 3 shards of 20; a batch, at most two windows.
    assert max(len(set(data.shards[batch].tolist())) for batch in through) <= 5


def test_locality_aware_sampling_opens_each_shard_about_once_where_a_global_shuffle_reopens_them(
    runs_of_shards: Path,
) -> None:
    opens = {}
    for name, sampler in zip(("global", "shards"), samplers(ClipDataset(runs_of_shards, "train"))):
        data = ClipDataset(ClipStore.open(runs_of_shards, max_open_shards=8), "train")
        for batch in sampler.batches(0, 125):  # 125 steps x 2 ranks x 8 clips: one epoch of 2,000
            for i in batch:
                data[i]
        opens[name] = data.store.opened
    assert opens["shards"] <= 3 * 100 // 2 and opens["global"] > 5 * opens["shards"], opens


SHARED_PLAN = """
import json, sys
from pathlib import Path
from clipforge.hpc.mpi import WorkList, mpi
MPI = mpi()
from clipforge.preprocess import pack
from clipforge.preprocess.corpus import SplitRatios
from clipforge.preprocess.decode import ClipParams
from clipforge.preprocess.pack import PackPlan, scan_corpus, video_table

checked = []
real_check = pack.check_paths
pack.check_paths = lambda root, rels: checked.append(len(rels)) or real_check(root, rels)
comm = MPI.COMM_WORLD
corpus = scan_corpus(Path(sys.argv[1]), SplitRatios(), ClipParams(), comm)
items = PackPlan(video_table(corpus), todo=list(range(len(corpus.videos)))).items() if comm.rank == 0 else None
work = WorkList(comm, items)
taken = [work.get(i) for i in range(comm.rank, len(work), 997)]
listed = [list(items[i]) for i in range(len(items))] if comm.rank == 0 else None  # rank 0's own list
print(json.dumps({"rank": comm.rank, "checked": checked, "items": len(work), "taken": [list(t) for t in taken],
                  "skipped": len(corpus.skipped) if comm.rank == 0 else None, "listed": listed}))
work.free()
"""


@pytest.mark.mpi
def test_ranks_share_the_stat_of_a_large_listing_and_fetch_only_the_work_they_take(
    tmp_path: Path, mpiexec, sample_videos
) -> None:
    """30,000 listed videos, 3 ranks: each checks a third of the paths; items come one by one from rank 0."""
    root = tmp_path / "corpus"
    (root / "real").mkdir(parents=True)
    lines = []
    for n in range(30_000):
        path = f"real/{n:05d}.mp4" if n % 10 == 0 else f"gone/{n:05d}.mp4"
        if n % 10 == 0:
            os.link(sample_videos[n % 3], root / path)  # hard links: distinct files to the scan
        lines.append(json.dumps({"path": path, "label": f"c{n % 7}"}))
    (root / "list.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [*mpiexec, "-n", "3", sys.executable, "-c", SHARED_PLAN, str(root / "list.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["checked"] for r in ranks] == [[10_000]] * 3
    assert ranks[0]["skipped"] == 27_000 and all(r["items"] == 3_000 for r in ranks)
    listed = ranks[0]["listed"]
    assert sorted(path for _, _, path in listed) == [f"real/{n:05d}.mp4" for n in range(0, 30_000, 10)]
    for r in ranks:  # what each rank fetched is rank 0's item at that index
        assert r["taken"] == [listed[i] for i in range(r["rank"], 3_000, 997)]
