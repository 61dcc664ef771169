"""Packing real videos into real HDF5 with real MPI ranks, and reading them back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch.utils.data import DataLoader

from clipforge.preprocess import synthetic
from clipforge.preprocess.corpus import CorpusError, scan
from clipforge.preprocess.decode import ClipParams, decode_clips
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.preprocess.store_format import StoreError

from .helpers import assert_same_store, clips_in_index_order, multinode_env, options, pack_argv, sbatch_wait

BROKEN = {"move_left/corrupt.mp4", "move_left/not_a_video.mp4", "move_left/truncated.mp4", "move_left/zero_bytes.mp4"}


PACK_SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "preprocess.py"


# -- the scan ---------------------------------------------------------------------------
def test_the_scan_is_sorted_and_reports_every_file_it_does_not_take(corpus: Path) -> None:
    c = scan(corpus)
    assert [v.path for v in c.videos] == sorted((v.path for v in c.videos), key=lambda p: (p.split("/")[0], p))
    assert c.classes == ["move_down", "move_left", "move_right", "move_up", "samples"]
    assert ("move_down/notes.txt", "extension .txt is not a video extension") in c.skipped
    assert scan(corpus).videos == c.videos  # deterministic


def test_a_manifest_can_give_splits(tmp_path: Path, corpus: Path) -> None:
    manifest = corpus / "manifest.csv"
    manifest.write_text("path,label,split\nmove_up/rotated.mp4,up,test\nmove_down/short.mp4,down,\n")
    try:
        c = scan(manifest)
    finally:
        manifest.unlink()
    assert [(v.path, v.label, v.split) for v in c.videos] == [
        ("move_down/short.mp4", "down", "train"),
        ("move_up/rotated.mp4", "up", "test"),
    ]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"path": "../outside.mp4", "label": "a"}', "outside the corpus root"),
        ('{"path": "/etc/passwd.mp4", "label": "a"}', "outside the corpus root"),
        ('{"path": "a.mp4", "label": "x/y"}', "must be a plain name without path separators"),
        ('{"path": "a.mp4", "label": "a"}\n{"path": "./a.mp4", "label": "b"}', "listed twice"),
        ('{"path": "a.mp4"}', 'each line needs "path" and "label"'),
    ],
)
def test_manifest_entries_that_are_ambiguous_or_leave_the_root_are_refused(
    tmp_path: Path, line: str, message: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.mp4").write_bytes(b"")
    (root / "manifest.jsonl").write_text(line + "\n")
    with pytest.raises(CorpusError, match=message):
        scan(root / "manifest.jsonl")


def test_a_symlink_out_of_the_corpus_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.mp4").write_bytes(b"x")
    (tmp_path / "root" / "cls").mkdir(parents=True)
    os.symlink(tmp_path / "secret.mp4", tmp_path / "root" / "cls" / "link.mp4")
    with pytest.raises(CorpusError, match="outside the corpus root"):
        scan(tmp_path / "root")


# -- decoding ------------------------------------------------------------------------------
def test_a_rotation_tag_turns_the_frames(tmp_path: Path) -> None:
    spec = synthetic.VideoSpec("move_right", frames=30, width=80, height=80, seed=3)
    plain = synthetic.write_video(tmp_path / "plain.mp4", spec)
    turned = synthetic.write_video(tmp_path / "turned.mp4", spec)
    synthetic.tag_rotation(turned, 90)
    params = ClipParams(clip_frames=4, height=40, width=40, clips_per_video=1)
    a, b = decode_clips(plain, params).clips[0], decode_clips(turned, params).clips[0]
    assert np.array_equal(b, np.rot90(a, k=-1, axes=(1, 2)))  # shown turned 90 degrees clockwise


def test_a_stream_without_duration_is_measured_by_its_frames(corpus: Path) -> None:
    result = decode_clips(corpus / "move_up" / "no_duration.h264", ClipParams(clip_frames=8, height=32, width=32))
    assert result.frames == 40 and result.duration == pytest.approx(40 / 25)
    assert result.clips.shape == (4, 8, 32, 32, 3)


def test_a_video_shorter_than_a_clip_is_looped_or_skipped(corpus: Path) -> None:
    short = corpus / "move_down" / "short.mp4"
    looped = decode_clips(short, ClipParams(clip_frames=8, frame_stride=1, height=32, width=32))
    assert looped.clips.shape[0] == 1 and np.array_equal(looped.clips[0, 0], looped.clips[0, 6])  # 6 frames, looped
    skipped = decode_clips(short, ClipParams(clip_frames=8, height=32, width=32, short_videos="skip"))
    assert skipped.clips.shape[0] == 0 and skipped.status.startswith("skipped")


def test_decoding_a_clip_gives_the_frames_on_screen_at_its_times(tmp_path: Path) -> None:
    spec = synthetic.VideoSpec("move_right", frames=50, fps=25, gop=10, codec="mjpeg", seed=4)
    path = synthetic.write_video(tmp_path / "v.mkv", spec)
    result = decode_clips(
        path, ClipParams(clip_frames=5, frame_stride=3, height=72, width=96, resize="stretch", clips_per_video=2)
    )
    truth = synthetic.render_frames(spec)
    start = round(result.starts[1] * 25)
    for i in range(5):
        assert np.abs(result.clips[1, i].astype(int) - truth[start + 3 * i]).mean() < 8  # JPEG round trip only


def test_a_textured_video_checkers_the_flat_videos_shape_and_leaves_the_flat_video_as_it_was() -> None:
    flat = synthetic.render_frames(synthetic.VideoSpec("move_right", frames=8, seed=5))
    textured = synthetic.render_frames(synthetic.VideoSpec("move_right", frames=8, seed=5, textured=True))
    colors, counts = np.unique(flat.reshape(-1, 3), axis=0, return_counts=True)
    assert len(colors) == 2  # background and shape only
    color = colors[counts.argmin()].astype(int)  # the shape's: it covers less of the frame
    shape = (flat == color).all(-1)
    # Where the flat video's shape is, the textured one shows its colour and a darker one, a checker board.
    assert {tuple(c) for c in textured[shape].astype(int)} == {tuple(color), tuple(color * 6 // 10)}
    assert len(np.unique(textured[~shape], axis=0)) > 100  # a background of waves, not one colour


# -- packing -------------------------------------------------------------------------------
@pytest.mark.mpi
def test_one_two_and_four_ranks_pack_the_same_clips(corpus: Path, clean_store: Path, tmp_path: Path, pack) -> None:
    reference = clips_in_index_order(clean_store)
    for ranks in (1, 4):
        pack(corpus, tmp_path / f"n{ranks}", ranks)
        clips, labels, paths = clips_in_index_order(tmp_path / f"n{ranks}")
        assert np.array_equal(clips, reference[0]) and np.array_equal(labels, reference[1]) and paths == reference[2]


@pytest.mark.mpi
def test_broken_videos_land_in_errors_jsonl_and_the_rest_is_packed(clean_store: Path, sample_videos) -> None:
    errors = [json.loads(line) for line in (clean_store / "errors.jsonl").read_text().splitlines()]
    failed = {e["path"] for e in errors if e["video_id"] is not None and not e["reason"].startswith("skipped")}
    assert failed == BROKEN
    assert any(e["path"] == "move_down/notes.txt" for e in errors)
    # A name that is not UTF-8 (Latin-1 here) is skipped with its reason, shown with a replacement character.
    assert any(e["path"] == "move_down/caf\ufffd.mp4" and "not valid UTF-8" in e["reason"] for e in errors), errors
    s = ClipStore.open(clean_store)
    ok = {p for p, status in zip(s.videos["path"], s.videos["status"]) if status == "ok"}
    assert {"move_up/rotated.mp4", "move_up/no_duration.h264", "move_down/short.mp4", "samples/bikes.mp4"} <= ok
    assert len(ok) == len(s.videos["path"]) - len(BROKEN)


@pytest.mark.mpi
def test_a_rank_killed_mid_run_then_a_rerun_gives_the_clean_stores_clips(
    corpus: Path, clean_store: Path, tmp_path: Path, mpiexec
) -> None:
    out = tmp_path / "store"
    argv = pack_argv(mpiexec, 2, corpus, out, clip_frames=8, height=32, width=32, clips_per_video=3, max_shard_clips=3)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        if list((out / "shards").glob("*.json")):
            victim = _rank_pid(1)
        time.sleep(0.01)
    assert victim is not None, "the job finished before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    proc.wait(timeout=120)
    assert not (out / "index.h5").exists()
    kept = {p.name for p in (out / "shards").glob("*.json")}
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # Open MPI starts quietly on a host without RDMA devices: no osc/ucx error lines in a packing log.
    assert "osc_ucx" not in rerun.stderr and " Error: " not in rerun.stderr, rerun.stderr[-3000:]
    assert kept <= {p.name for p in (out / "shards").glob("*.json")}  # committed shards were kept, not redone
    for ours, clean in zip(clips_in_index_order(out), clips_in_index_order(clean_store)):
        assert np.array_equal(np.asarray(ours), np.asarray(clean))


def _rank_pid(rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ
            and b"clipforge.jobs.preprocess" in (entry / "cmdline").read_bytes()
        ):
            return int(entry.name)
    return None


@pytest.mark.mpi
def test_a_rerun_with_other_parameters_refuses_unless_overwrite(corpus: Path, tmp_path: Path, pack) -> None:
    out = tmp_path / "store"
    pack(corpus, out, 1)
    refused = pack(corpus, out, 1, "--clip-frames", "4", check=False)
    assert refused.returncode != 0
    assert (
        "was packed with other parameters (clip_frames differ)" in refused.stderr and "Traceback" not in refused.stderr
    )
    pack(corpus, out, 1, "--clip-frames", "4", "--overwrite")
    assert ClipStore.open(out).read_clip(0).shape == (4, 32, 32, 3)


def test_a_deleted_or_truncated_shard_fails_its_first_read_and_verify_naming_it(
    clean_store: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(clean_store, copy)
    store = ClipStore.open(copy)  # opening reads index.h5 alone
    shard = copy / "shards" / store.shard_names[int(np.searchsorted(store.shard_offsets, 0, side="right") - 1)]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(StoreError, match=rf"{shard.name} is 1000 bytes but the index says"):
        store.read_clip(0)
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "store", "verify", str(copy)]
    verify = subprocess.run(cli, capture_output=True, text=True)
    assert verify.returncode == 2 and "is 1000 bytes but the index says" in verify.stderr, verify.stderr
    shard.unlink()
    with pytest.raises(StoreError, match=rf"{shard} is missing from the store"):
        ClipStore.open(copy).read_clip(0)
    ok = subprocess.run([*cli[:-1], str(clean_store)], capture_output=True, text=True, check=True)
    assert "every one present with its recorded size" in ok.stdout


def test_the_reader_in_a_two_worker_dataloader_returns_the_direct_reads(clean_store: Path) -> None:
    dataset = ClipDataset(clean_store, "train")
    loaded = [(c, y) for c, y in DataLoader(dataset, batch_size=4, num_workers=2, shuffle=False)]
    clips = np.concatenate([c.numpy() for c, _ in loaded])
    labels = np.concatenate([y.numpy() for _, y in loaded])
    direct = ClipStore.open(clean_store)
    assert len(clips) == len(dataset) > 0
    assert np.array_equal(clips, np.stack([direct.read_clip(int(p)) for p in dataset.positions]))
    assert np.array_equal(labels, direct.labels[dataset.positions])


def test_h5ls_and_h5dump_can_read_the_store(clean_store: Path) -> None:
    listing = subprocess.run(
        ["h5ls", "-r", str(clean_store / "index.h5")], capture_output=True, text=True, check=True
    ).stdout
    for name in ("/clips", "/labels", "/classes", "/splits/train", "/videos/path", "/shards/name"):
        assert name in listing
    dump = subprocess.run(
        ["h5dump", "-d", "/classes", str(clean_store / "index.h5")], capture_output=True, text=True, check=True
    ).stdout
    assert '"move_down"' in dump
    with h5py.File(
        clean_store / "index.h5", "r", locking=False
    ) as f:  # the virtual dataset reads through to the shards
        s = ClipStore.open(clean_store)
        assert np.array_equal(f["clips"][0], s.read_clip(0))


@pytest.mark.mpi
def test_the_jpeg_codec_is_smaller_and_close_to_raw(corpus: Path, clean_store: Path, tmp_path: Path, pack) -> None:
    pack(corpus, tmp_path / "jpeg", 2, "--codec", "jpeg")
    raw, _, _ = clips_in_index_order(clean_store)
    jpeg, _, _ = clips_in_index_order(tmp_path / "jpeg")
    assert jpeg.shape == raw.shape
    assert np.abs(jpeg.astype(int) - raw.astype(int)).mean() < 6
    size = lambda store: sum(p.stat().st_size for p in (store / "shards").glob("*.h5"))  # noqa: E731
    assert size(tmp_path / "jpeg") < size(clean_store) / 2


@pytest.mark.mpi
def test_append_adds_new_videos_as_new_shards_without_rewriting_old_ones(corpus: Path, tmp_path: Path, pack) -> None:
    import shutil

    part = tmp_path / "corpus"
    shutil.copytree(corpus / "move_right", part / "move_right")
    out = tmp_path / "store"
    pack(part, out, 2)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in (out / "shards").glob("*.h5")}
    shutil.copytree(corpus / "move_up", part / "move_up")
    pack(part, out, 2, "--append")
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in (out / "shards").glob("*.h5")}
    assert all(after[name] == stat for name, stat in before.items()) and len(after) > len(before)
    s = ClipStore.open(out)
    assert s.classes == ["move_right", "move_up"]
    assert set(s.videos["path"][s.video_ids]) == {p for p in s.videos["path"]}


@pytest.mark.slurm
@pytest.mark.mpi
def test_sbatch_runs_the_packing_job_as_mpi_ranks_under_srun(
    slurm, corpus: Path, clean_store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    flags = options(videos=corpus, out=out, clip_frames=8, height=32, width=32, clips_per_video=3, max_shard_clips=12)
    result = sbatch_wait("--ntasks=2", f"--output={tmp_path / 'slurm.out'}", str(PACK_SCRIPT), *flags)
    log = (tmp_path / "slurm.out").read_text()
    assert result.returncode == 0, log[-3000:]
    assert "re-launching under srun with 2 tasks" in log
    assert np.array_equal(clips_in_index_order(out)[0], clips_in_index_order(clean_store)[0])


def test_the_local_executor_starts_mpi_ranks_with_mpiexec(corpus: Path, clean_store: Path, tmp_path: Path) -> None:
    from clipforge.hpc.launch import run_script

    out = tmp_path / "store"
    flags = options(executor="local", ntasks_per_node=2, videos=corpus, out=out)
    run_script("clipforge.jobs.preprocess", flags + options(clip_frames=8, height=32, width=32, clips_per_video=3))
    assert np.array_equal(clips_in_index_order(out)[0], clips_in_index_order(clean_store)[0])


@pytest.mark.slurm
@pytest.mark.mpi
def test_packing_with_ranks_on_three_nodes_gives_the_one_node_store(
    multinode, corpus: Path, clean_store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    flags = options(videos=corpus, out=out, clip_frames=8, height=32, width=32, clips_per_video=3, max_shard_clips=12)
    result = sbatch_wait(
        "-N3",
        "--ntasks-per-node=1",
        f"--output={tmp_path / 'slurm.out'}",
        str(PACK_SCRIPT),
        *flags,
        env=multinode_env(multinode),
    )
    log = (tmp_path / "slurm.out").read_text()
    assert result.returncode == 0, log[-3000:]
    assert "re-launching under srun with 3 tasks" in log
    assert "osc_ucx" not in log and " Error: " not in log, log[-3000:]  # ranks started by srun start quietly too
    assert_same_store(out, clean_store)


@pytest.mark.slurm
@pytest.mark.mpi
def test_packing_that_loses_a_node_is_requeued_and_keeps_its_committed_shards(
    multinode, corpus: Path, clean_store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    flags = options(videos=corpus, out=out, clip_frames=8, height=32, width=32, clips_per_video=3, max_shard_clips=4)
    env = multinode_env(multinode)
    argv = ["sbatch", "--parsable", "--requeue", "--open-mode=append", "-N2", "--ntasks-per-node=1"]
    submitted = subprocess.run(
        [*argv, f"--output={tmp_path / 'slurm.out'}", str(PACK_SCRIPT), *flags], capture_output=True, text=True, env=env
    )
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    while not list((out / "shards").glob("shard-*.json")):  # the first shard is committed
        assert time.monotonic() < deadline, "packing never committed a shard"
        time.sleep(0.02)
    held = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True, env=env).stdout
    victim = "n2" if "2" in held else "n3"  # never n1, the batch host
    multinode.kill_node(victim)
    try:
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env).stdout.strip():
            assert time.monotonic() < deadline + 240, "the packing job never finished"
            time.sleep(0.5)
    finally:
        multinode.start_node(victim)
    log = (tmp_path / "slurm.out").read_text()
    kept = [int(n) for n in re.findall(r"already packed in (\d+) shards", log)]
    assert len(kept) == 2 and kept[0] == 0 and kept[1] >= 1, log[-3000:]  # the rerun started from what was committed
    assert_same_store(out, clean_store)
