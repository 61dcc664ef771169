"""Evaluation and prediction as jobs: multi-view testing over real ranks, and batch prediction that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from clipforge.base.errors import UserError
from clipforge.inference.prediction import PredictionLog
from clipforge.inference.views import Views, spatial_crops
from clipforge.preprocess.reader import StoredVideos, evenly

from .early import Runs
from .helpers import losses, options, sbatch_wait


@pytest.fixture(scope="module")
def cropped_run(early) -> Path:
    """A bf16 ZeRO-2 run on 24x24 crops of the 32x32 store: room for three spatial views (helpers.EARLY_TRAININGS,
    started alone when this module runs alone)."""
    return Runs(early)["cropped"]


def job(module: str, *args: str, timeout: int = 300, code: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", f"clipforge.jobs.{module}", *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == code, result.stderr[-3000:]
    return result


def test_bf16_trains_and_logs_mfu_and_the_data_wait(cropped_run: Path) -> None:
    assert all(np.isfinite(v) for v in losses(cropped_run).values())
    rows = [json.loads(line) for line in (cropped_run / "metrics.jsonl").read_text().splitlines()]
    figures = [r for r in rows if r["kind"] == "throughput"]
    assert figures and all(0 < r["mfu"] < 1 and 0 <= r["data_wait"] <= 1 and r["clips_per_s"] > 0 for r in figures)


def test_spatial_views_slide_along_the_long_side_and_temporal_views_spread_evenly() -> None:
    clips = torch.arange(2 * 1 * 4 * 8 * 3, dtype=torch.int32).reshape(2, 1, 4, 8, 3)
    crops = spatial_crops(clips, 4, 3)
    assert crops.shape == (6, 1, 4, 4, 3)
    assert torch.equal(crops[0], clips[0, :, :, 0:4]) and torch.equal(crops[1], clips[0, :, :, 2:6])
    assert torch.equal(crops[2], clips[0, :, :, 4:8]) and torch.equal(crops[3], clips[1, :, :, 0:4])
    tall = clips.transpose(2, 3)  # 8 high, 4 wide: the crops slide down
    assert torch.equal(spatial_crops(tall, 4, 3)[2], tall[0, :, 4:8, :])
    assert evenly(10, 5).tolist() == [0, 2, 4, 7, 9] and evenly(4, 0).tolist() == [0, 1, 2, 3]
    assert evenly(4, 9).tolist() == [0, 1, 2, 3] and evenly(5, 1).tolist() == [2]
    with pytest.raises(UserError, match="all crops would be the same"):
        Views(spatial=3).check(None, 32, 32)


def test_multi_view_evaluation_on_two_ranks_equals_one_rank(cropped_run: Path, tiny_store: Path) -> None:
    views = ["--views.temporal", "3", "--views.spatial", "3", "--views.source", "videos", "--split", "val"]
    job("evaluate", "--run", str(cropped_run), *views, "--executor", "debug", "--ntasks-per-node", "1")
    one = json.loads((cropped_run / "eval-val.json").read_text())
    job("evaluate", "--run", str(cropped_run), *views, "--executor", "local", "--ntasks-per-node", "2")
    two = json.loads((cropped_run / "eval-val.json").read_text())
    videos = len(StoredVideos(tiny_store, "val"))
    assert one["videos"] == two["videos"] == videos and one["clips"] == two["clips"] == videos * 9
    for key in ("clip_top1", "clip_top5", "video_top1", "video_top5", "loss"):
        assert two[key] == pytest.approx(one[key], abs=1e-6), key
    assert two["confusion"] == one["confusion"] and "3 clips x 3 crops, from the videos" in two["views"]


def test_evaluation_from_the_stored_clips_matches_the_runs_own(cropped_run: Path) -> None:
    result = job("evaluate", "--run", str(cropped_run), "--split", "val", "--executor", "debug")
    evaluated = json.loads((cropped_run / "eval-val.json").read_text())
    final = json.loads((cropped_run / "eval.json").read_text())
    assert evaluated["video_top1"] == pytest.approx(final["video_top1"])
    assert evaluated["clip_top1"] == pytest.approx(final["clip_top1"])
    assert "the stored clips x 1 crop" in result.stdout


def test_views_the_model_cannot_take_are_refused_in_one_line(zero_free_run: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.evaluate", "--run", str(zero_free_run), "--views.spatial", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "use --views.spatial 1" in result.stderr.strip().splitlines()[-1]


def test_a_videos_root_with_views_from_the_store_is_refused_in_one_line(cropped_run: Path) -> None:
    """Once accepted and ignored: the clips come from the store unless the views decode the videos again."""
    from clipforge.jobs import config as job_config
    from clipforge.jobs import evaluate

    cfg = evaluate.parse(["--run", str(cropped_run), "--videos-root", "/elsewhere"])
    with pytest.raises(job_config.ConfigError, match="--videos-root /elsewhere is read only with --views.source"):
        evaluate.check(cfg)


@pytest.fixture(scope="module")
def zero_free_run(cropped_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cropped run's record with its crop removed: a model that sees whole frames."""
    import shutil

    run = tmp_path_factory.mktemp("uncropped") / "run"
    shutil.copytree(cropped_run / "final", run / "final")
    record = json.loads((run / "final" / "run.json").read_text())
    record["crop"] = None
    (run / "final" / "run.json").write_text(json.dumps(record))
    return run


def manifest_of(tiny_store: Path, folder: Path, copies: int) -> Path:
    """A manifest of ``copies`` links to each source video, a missing file and a broken one."""
    sources = sorted((tiny_store.parent / "videos").rglob("*.mp4"))
    folder.mkdir(parents=True)
    lines = []
    for n in range(copies):
        for src in sources:
            link = folder / f"{n}-{src.name}"
            link.symlink_to(src)
            lines.append(str(link))
    (folder / "broken.mp4").write_bytes(b"not a video")
    lines += [str(folder / "missing.mp4"), str(folder / "broken.mp4")]
    manifest = folder / "manifest.txt"
    manifest.write_text("# videos to classify\n" + "\n".join(lines) + "\n")
    return manifest


def test_batch_prediction_killed_midway_resumes_and_writes_each_video_once(
    cropped_run: Path, tiny_store: Path, tmp_path: Path
) -> None:
    manifest = manifest_of(tiny_store, tmp_path / "videos", copies=4)
    wanted = [line for line in manifest.read_text().splitlines() if not line.startswith("#")]
    out = tmp_path / "predictions.jsonl"
    argv = ["--manifest", str(manifest), "--out", str(out), "--run", str(cropped_run), "--top", "2", "--workers", "0"]
    # One rank started directly (the launcher's rank context), killed with SIGKILL once some lines are written.
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipforge.jobs.predict", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    part = out.parent / f"{out.name}.parts" / "rank-00000.jsonl"
    deadline = time.monotonic() + 120
    while not (part.exists() and part.read_text().count("\n") >= 10):
        assert proc.poll() is None and time.monotonic() < deadline, "prediction ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = part.read_text().count("\n")
    with open(part, "a") as f:
        f.write('{"video": "cut short by the kil')  # the line a kill interrupts
    result = job("predict", *argv, "--executor", "local", "--ntasks-per-node", "2", code=2)
    assert f"{before} of {len(wanted)} videos already predicted" in result.stderr
    # The submitter prints the job's own reason, then where its log is.
    reason = result.stderr.strip().splitlines()[-1]
    assert reason.startswith("clipforge: error: job ") and "failed: 2 of " in reason, result.stderr[-2000:]
    assert f"2 of {len(wanted)} videos could not be classified (their lines in {out} say why)" in reason
    assert "full log: " in reason
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["video"] for line in lines) == sorted(wanted)  # each once, none lost, none twice
    errors = {line["video"]: line["error"] for line in lines if "error" in line}
    assert set(errors) == {str(tmp_path / "videos" / "missing.mp4"), str(tmp_path / "videos" / "broken.mp4")}
    assert all(len(line["top"]) == 2 and line["views"] == 4 for line in lines if "top" in line)
    assert not part.parent.exists()
    # A rerun finds everything done and changes nothing, and still says that two videos failed.
    rerun = job("predict", *argv, "--executor", "debug", code=2)
    assert f"2 of {len(wanted)} videos could not be classified" in rerun.stderr.strip().splitlines()[-1]
    assert out.read_text().count("\n") == len(wanted)


def test_a_prediction_log_cuts_a_partial_line_and_merges_each_video_once(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    out.write_text('{"video": "a", "top": []}\n')
    log = PredictionLog(out, rank=1)
    log.parts.mkdir()
    (log.parts / "rank-00001.jsonl").write_text('{"video": "a", "top": []}\n{"video": "b"')
    assert log.done() == {"a"}
    log.append({"video": "c", "top": []})
    assert log.merge() == 1
    assert [json.loads(line)["video"] for line in out.read_text().splitlines()] == ["a", "c"]


@pytest.mark.slurm
def test_sbatch_of_predict_spreads_a_manifest_over_two_slurm_tasks(
    slurm, cropped_run: Path, tiny_store: Path, tmp_path: Path
) -> None:
    manifest = manifest_of(tiny_store, tmp_path / "videos", copies=1)
    out = tmp_path / "predictions.jsonl"
    script = Path(__file__).resolve().parents[1] / "jobs" / "predict.py"
    result = sbatch_wait(
        "--ntasks-per-node=2",
        f"--output={tmp_path / 'slurm-%j.out'}",
        str(script),
        *options(manifest=manifest, out=out, run=cropped_run, workers=0),
    )
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert result.returncode != 0, result.stderr + log[-3000:]  # two of the videos cannot be classified
    assert "clipforge: error: 2 of " in log and "Traceback" not in log, log[-3000:]
    assert "re-launching under srun with 2 tasks" in log and "[rank 1] INFO clipforge.predict: " in log
    wanted = [line for line in manifest.read_text().splitlines() if not line.startswith("#")]
    assert sorted(json.loads(line)["video"] for line in out.read_text().splitlines()) == sorted(wanted)
