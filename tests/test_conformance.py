"""The conformance corpus packed at 1 and 2 MPI ranks: every file frame-exact, or reported with its reason.

Each frame of the corpus carries its label as a bar code, so every packed frame
is checked against the source frame the clip parameters ask for: frame ``i``
of a clip starting at ``start`` is display frame ``round(start * fps) + i *
stride`` of a plain decode of the whole file, or for a variable frame rate the
frame on screen at ``start + i * stride / fps``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest

from clipforge.preprocess.conformance import CASES, Case, read_label, write_corpus
from clipforge.preprocess.decode import TOLERANCE, ClipParams, decode_clips
from clipforge.preprocess.store import ClipStore, read_errors

from .helpers import assert_same_store, pack_argv

pytestmark = pytest.mark.mpi
CLIP = {"clip_frames": 8, "frame_stride": 2, "clips_per_video": 3, "height": 96, "width": 128}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Case]]:
    root = tmp_path_factory.mktemp("conformance") / "videos"
    return root, write_corpus(root / "conformance")  # one class folder


@pytest.fixture(scope="module")
def stores(corpus, tmp_path_factory: pytest.TempPathFactory, mpiexec) -> dict[int, Path]:
    out = {}
    for ranks in (1, 2):
        store = tmp_path_factory.mktemp(f"conformance-{ranks}") / "store"
        result = subprocess.run(
            pack_argv(mpiexec, ranks, corpus[0], store, **CLIP, max_shard_clips=6),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        out[ranks] = store
    assert "2 partial or damaged, 2 failed" in result.stderr, result.stderr[-2000:]
    return out


def plain_decode(path: Path, case: Case) -> list[int]:
    """Labels of a plain decode of the whole file in output order, up to where it fails."""
    size = case.size[::-1] if case.rotation % 2 else case.size  # PyAV does not apply the rotation tag
    labels = []
    try:
        with av.open(str(path)) as container:
            for frame in container.decode(video=0):
                labels.append(read_label(frame.to_ndarray(format="rgb24"), size))
    except av.error.FFmpegError:
        pass
    return labels


def expected(case: Case, shown: list[int], start: float, fps: float) -> list[int]:
    stride, frames = CLIP["frame_stride"], CLIP["clip_frames"]
    first = round(start * fps)
    if case.truth == "position":
        return [first + i * stride for i in range(frames)]
    if case.truth == "slot":  # the frame on screen at each time: the latest one shown by then
        times = [start + i * stride / fps + TOLERANCE / fps for i in range(frames)]
        return [max(label for label in shown if label * case.slot <= t + 1e-9) for t in times]
    return [shown[first + i * stride] for i in range(frames)]


def test_one_and_two_ranks_pack_the_conformance_corpus_the_same(stores) -> None:
    assert_same_store(stores[1], stores[2])


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_file_is_packed_frame_exact_or_reported_with_its_reason(name: str, corpus, stores) -> None:
    root, cases = corpus
    case = next(c for c in cases if c.name == name)
    store = ClipStore.open(stores[2])
    row = list(store.videos["path"]).index(f"conformance/{name}")
    status = store.videos["status"][row]
    errors = {e["path"]: e for e in read_errors(stores[2])}
    if case.expect == "error":
        assert status.startswith("failed") and case.reason in status, status
        assert errors[f"conformance/{name}"]["level"] == "error"
        return
    if case.expect == "exact":
        assert status == "ok", status
    else:
        assert status.startswith(case.expect), status
        assert errors[f"conformance/{name}"]["level"] == "warning"
    if case.timing:
        assert store.videos["timing"][row] == case.timing
    fps, duration = float(store.videos["fps"][row]), float(store.videos["duration"][row])
    shown = plain_decode(root / "conformance" / name, case)
    positions = np.flatnonzero(store.video_ids == row)
    positions = positions[np.argsort(store.clip_index[positions])]
    assert len(positions) >= (1 if case.expect == "damaged" else CLIP["clips_per_video"])
    for p in positions:
        start = float(store.start_times[p])
        last = start + (CLIP["clip_frames"] - 1) * CLIP["frame_stride"] / fps
        assert last < duration  # every frame inside what decodes
        got = [read_label(frame, case.size, case.rotation) for frame in store.read_clip(int(p))]
        assert got == expected(case, shown, start, fps), (start, got)


def test_prediction_decodes_the_same_frames_as_packing(corpus, stores) -> None:
    root, cases = corpus
    store = ClipStore.open(stores[1])
    params = ClipParams(**CLIP)
    for case in cases:
        if case.expect == "error":
            continue
        row = list(store.videos["path"]).index(f"conformance/{case.name}")
        positions = np.flatnonzero(store.video_ids == row)
        positions = positions[np.argsort(store.clip_index[positions])]
        again = decode_clips(root / "conformance" / case.name, params)
        assert np.array_equal(again.clips, np.stack([store.read_clip(int(p)) for p in positions])), case.name


def test_store_inspect_shows_timing_spans_and_the_files_worth_a_look(stores) -> None:
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "store", "inspect", str(stores[2])]
    text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "worth a look" in text
    for name in ("truncated.avi", "corrupt_gop.mp4", "h264_broken_ctts.mp4", "h264_rewritten_pts.mkv"):
        assert name in text, text
    assert "decoded 71 of 100 frames" in text or "partial: decoded" in text, text
    report = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
    assert report["videos"] == 16 and report["status"]["partial"] == 1 and report["status"]["damaged"] == 1
    assert report["status"]["failed"] == 2 and report["timing"]["order"] >= 2
    by_path = {v["path"]: v for v in report["per_video"]}
    truncated = by_path["conformance/truncated.avi"]
    assert truncated["promised_frames"] == 100 and 0 < truncated["frames"] < 100
    assert truncated["last_time"] < 4.0 - 0.5
    # Timing by broken timestamps is what repeats frames ([0, 0, 4, 4, ...] for stride 2): no clip here does.
    assert report["repeated_clips"] == 0 and by_path["conformance/h264_rewritten_pts.mkv"]["timing"] == "order"
