"""Fast unit tests, no Slurm and no subprocess: the checkpoint index, the throughput meter, the resume decisions."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from clipforge.base.files import sha256
from clipforge.hpc.accelerator import Peak
from clipforge.hpc.distenv import DistEnv
from clipforge.rundir import CheckpointIndex
from clipforge.train import throughput
from clipforge.train.resume import plan_resume
from clipforge.train.settings import TrainError, TrainSettings
from clipforge.train.throughput import Throughput

# -- the checkpoint index -----------------------------------------------------------------


def save(index: CheckpointIndex, step: int, writers: dict | None = None, complete: bool = True) -> str:
    """A checkpoint of two small files after ``step``, marked complete unless ``complete`` is False."""
    tag = index.tag(step)
    (index.path(tag) / "zero").mkdir(parents=True)
    (index.path(tag) / "model.pt").write_bytes(b"weights %d" % step)
    (index.path(tag) / "zero" / "optim.pt").write_bytes(b"optimizer %d" % step)
    if complete:
        index.mark_complete(tag, step, writers)
    return tag


def test_checkpoint_tags_sort_by_step() -> None:
    tags = [CheckpointIndex.tag(step) for step in (9, 10, 100, 12345678)]
    assert tags[0] == "step-00000009" and sorted(tags) == tags


def test_only_checkpoints_with_a_completion_record_count_newest_first(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path / "checkpoints")
    assert index.complete() == [] and index.newest_usable() is None  # no folder yet
    for step in (4, 12, 8):
        save(index, step)
    save(index, 16, complete=False)  # cut short by a crash: no complete.json
    assert index.complete() == ["step-00000012", "step-00000008", "step-00000004"]
    assert not index.is_complete("step-00000016") and index.newest_usable() == "step-00000012"
    assert json.loads((index.folder / "latest.json").read_text()) == {"tag": "step-00000008"}  # the last marked


def test_the_completion_record_lists_every_file_with_its_checksum_but_the_rank_manifests(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path)
    tag = index.tag(4)
    index.path(tag).mkdir()
    (index.path(tag) / "model.pt").write_bytes(b"weights")
    index.write_manifest(tag, 0, {"model.pt": {"sha256": sha256(index.path(tag) / "model.pt"), "bytes": 7}})
    (index.path(tag) / "extra.json").write_text("{}")  # named by no manifest: hashed when marked complete
    index.mark_complete(tag, 4, {"data_parallel": 2, "global_batch": 8}, files=index.manifests(tag)[0])
    record = json.loads((index.path(tag) / "complete.json").read_text())
    assert sorted(record["files"]) == ["extra.json", "model.pt"]
    assert record["files"]["extra.json"] == {"sha256": sha256(index.path(tag) / "extra.json"), "bytes": 2}
    assert index.step(tag) == 4 and index.writers(tag) == {"data_parallel": 2, "global_batch": 8}
    assert index.verify(tag) is None


def test_the_rank_manifests_are_read_in_rank_order_and_a_torn_one_is_left_out(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path)
    index.path("step-00000004").mkdir()
    index.write_manifest("step-00000004", 1, {"b": {"sha256": "2", "bytes": 1}})
    index.write_manifest("step-00000004", 0, {"a": {"sha256": "1", "bytes": 1}})
    (index.path("step-00000004") / ".rank-00002.json").write_text('{"c": ')  # still being written
    assert index.manifests("step-00000004") == [{"a": {"sha256": "1", "bytes": 1}}, {"b": {"sha256": "2", "bytes": 1}}]


def test_a_checkpoint_with_a_file_missing_changed_or_an_unreadable_record_does_not_verify(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path)
    missing, changed, unreadable = save(index, 4), save(index, 8), save(index, 12)
    (index.path(missing) / "zero" / "optim.pt").unlink()
    (index.path(changed) / "model.pt").write_bytes(b"weights 8, changed")
    (index.path(unreadable) / "complete.json").write_text("{")
    assert index.verify(missing) == "zero/optim.pt is missing"
    assert index.verify(changed) == "model.pt does not match its checksum"
    assert index.verify(unreadable).startswith("unreadable completion record")


def test_the_newest_usable_checkpoint_passes_over_the_ones_that_do_not_verify_and_says_why(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path)
    good = save(index, 4)
    for step in (8, 12):
        (index.path(save(index, step)) / "model.pt").write_bytes(b"bit rot")
    passed_over: list[tuple[str, str]] = []
    assert index.newest_usable(lambda tag, why: passed_over.append((tag, why))) == good
    assert passed_over == [(index.tag(s), "model.pt does not match its checksum") for s in (12, 8)]


def test_pruning_keeps_the_newest_complete_checkpoints_and_leaves_one_being_written(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path)
    for step in (4, 8, 12):
        save(index, step)
    writing = save(index, 16, complete=False)
    assert index.prune(keep=2) == ["step-00000004"]
    assert index.complete() == ["step-00000012", "step-00000008"] and index.path(writing).is_dir()
    assert index.writers("step-00000004") is None  # gone: no record of its writers, no error


# -- the throughput meter -----------------------------------------------------------------


class Clock:
    """perf_counter for the meter, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=clock))
    return clock


def test_a_window_gives_clips_per_second_data_wait_tflops_and_mfu(clock: Clock) -> None:
    meter = Throughput(clips_per_step=16, flops_per_clip=1e12, peak=Peak(24.0, "datasheet", "X"), devices=2)
    meter.start()
    clock.now += 2.0
    meter.steps_done(1)
    clock.now += 2.0
    meter.waited = 1.0  # of the 4 s, 1 s blocked in the loader
    meter.steps_done(3)
    figures = meter.figures()
    assert figures["clips_per_s"] == pytest.approx(4 * 16 / 4.0)
    assert figures["data_wait"] == pytest.approx(0.25)
    assert figures["tflops"] == pytest.approx(3 * 1e12 * 16 / 1e12)  # forward and backward: three forwards
    assert figures["mfu"] == pytest.approx(48 / (24.0 * 2))


def test_each_window_starts_where_the_last_log_line_ended(clock: Clock) -> None:
    meter = Throughput(clips_per_step=8, flops_per_clip=None, peak=None, devices=1)
    meter.start()
    clock.now += 1.0
    meter.steps_done(2)
    meter.figures()
    assert meter.figures() == {}  # no step since the last line
    clock.now += 4.0
    meter.steps_done(2)
    assert meter.figures() == {"clips_per_s": pytest.approx(2 * 8 / 4.0), "data_wait": 0.0}


def test_the_summary_leaves_out_the_first_step_and_a_one_step_run_has_none(clock: Clock) -> None:
    meter = Throughput(clips_per_step=4, flops_per_clip=1e9, peak=Peak(10.0, "measured", "cpu"), devices=1)
    meter.start()
    clock.now += 30.0  # the first step: warm-up and compilation
    meter.steps_done(1)
    assert meter.summary() == {}
    for _ in range(5):
        clock.now += 0.5
        meter.steps_done(1)
    summary = meter.summary()
    assert summary["clips_per_s"] == pytest.approx(5 * 4 / 2.5)
    assert (summary["peak_tflops"], summary["peak_source"], summary["device"]) == (10.0, "measured", "cpu")


def test_a_peak_not_in_the_datasheet_is_measured_in_the_dtype_the_runs_matmuls_take() -> None:
    import torch

    from clipforge.hpc.accelerator import peak

    # A bf16 run's MFU read 1.02 in a busy suite: its peak was an fp32 rate (this machine's AVX512-BF16 cores
    # multiply bf16 2.3x faster), and the mean of a fifth of a second while other processes had the cores.
    for precision in ("fp32", "bf16", "fp16"):
        measured = peak(torch.device("cpu"), precision)
        assert measured.source == f"measured, {precision}" and measured.tflops > 0, measured


def test_without_flops_or_a_peak_the_meter_gives_no_tflops_or_no_mfu(clock: Clock) -> None:
    for flops, peak, keys in ((None, None, set()), (1e9, None, {"tflops"})):
        meter = Throughput(clips_per_step=1, flops_per_clip=flops, peak=peak, devices=1)
        meter.start()
        clock.now += 1.0
        meter.steps_done(1)
        meter.steps_done(0)  # nothing finished: ignored
        assert meter.steps == 1
        assert set(meter.figures()) == {"clips_per_s", "data_wait"} | keys


def test_the_timed_loader_yields_its_items_unchanged_and_adds_up_the_wait(clock: Clock) -> None:
    def slow_loader():
        for item in ("a", "b", "c"):
            clock.now += 0.25  # the loop is blocked while the next batch is made
            yield item

    meter = Throughput(clips_per_step=1, flops_per_clip=None, peak=None, devices=1)
    assert list(meter.timed(slow_loader())) == ["a", "b", "c"]
    assert meter.waited == pytest.approx(0.75)


# -- the resume decisions ------------------------------------------------------------------

MAIN = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500)


def settings(zero_stage: int = 2, batch_per_rank: int = 2, pipeline_stages: int = 1) -> TrainSettings:
    s = TrainSettings(batch_per_rank=batch_per_rank)
    s.parallel.zero_stage, s.parallel.pipeline_stages = zero_stage, pipeline_stages
    return s


def written_by(tmp_path: Path, data_parallel: int, global_batch: int, step: int = 4) -> CheckpointIndex:
    """A run directory's index with one checkpoint written by ``data_parallel`` ranks."""
    index = CheckpointIndex(tmp_path / "checkpoints")
    save(index, step, {"world_size": data_parallel, "data_parallel": data_parallel, "global_batch": global_batch})
    return index


def test_a_run_without_a_checkpoint_starts_from_its_weights_fetched_once(tmp_path: Path) -> None:
    index = CheckpointIndex(tmp_path / "checkpoints")
    fetched: list[str] = []

    def fetch() -> Path:
        fetched.append("registry")
        return tmp_path / "start.safetensors"

    plan = plan_resume(settings(), index, MAIN, dp_size=2, elastic=False, fetch_weights=fetch)
    assert (plan.checkpoint, plan.step, plan.reshard, plan.weights) == (None, 0, False, tmp_path / "start.safetensors")
    assert fetched == ["registry"] and plan.universal_tag is None
    plain = plan_resume(settings(), index, MAIN, dp_size=2, elastic=False, fetch_weights=None)
    assert plain.weights is None and plain.grad_accum == 1


def test_a_run_resumes_from_its_newest_usable_checkpoint_on_the_same_ranks_as_it_is(tmp_path: Path) -> None:
    index = written_by(tmp_path, data_parallel=2, global_batch=4)
    save(index, 8, {"data_parallel": 2, "global_batch": 4})
    (index.path("step-00000008") / "model.pt").write_bytes(b"torn")
    fetched: list[str] = []
    plan = plan_resume(settings(), index, MAIN, dp_size=2, elastic=False, fetch_weights=lambda: fetched.append("x"))
    assert (plan.checkpoint, plan.step, plan.grad_accum, plan.reshard) == ("step-00000004", 4, 1, False)
    assert plan.weights is None
    assert fetched == []  # a run with a checkpoint never needs its starting weights


def test_a_checkpoint_from_other_ranks_is_refused_without_elastic_and_names_both_counts(tmp_path: Path) -> None:
    index = written_by(tmp_path, data_parallel=4, global_batch=8)
    with pytest.raises(TrainError, match="written by 4 data-parallel ranks and this job has 2: run it on 4"):
        plan_resume(settings(), index, MAIN, dp_size=2, elastic=False, fetch_weights=None)


@pytest.mark.parametrize("zero_stage,reshard", [(0, False), (1, True), (2, True)])
def test_an_elastic_restart_on_fewer_ranks_keeps_the_global_batch_by_accumulating(
    tmp_path: Path, zero_stage: int, reshard: bool
) -> None:
    index = written_by(tmp_path, data_parallel=4, global_batch=8)  # 4 ranks x 2 clips
    plan = plan_resume(settings(zero_stage), index, MAIN, dp_size=2, elastic=True, fetch_weights=None)
    assert (plan.checkpoint, plan.step, plan.grad_accum, plan.reshard) == ("step-00000004", 4, 2, reshard)
    assert plan.universal_tag == ("step-00000004-universal" if reshard else None)


@pytest.mark.parametrize(
    "s,message",
    [
        (settings(zero_stage=3), "reshards ZeRO 0-2 data parallel only"),
        (settings(zero_stage=1, pipeline_stages=2), "reshards ZeRO 0-2 data parallel only"),
        (settings(batch_per_rank=3), "global batch of 8 clips does not divide over 2 ranks of 3"),
    ],
    ids=["zero3", "pipeline", "batch-not-dividing"],
)
def test_an_elastic_restart_that_cannot_keep_the_run_is_refused(tmp_path: Path, s: TrainSettings, message: str) -> None:
    index = written_by(tmp_path, data_parallel=4, global_batch=8)
    with pytest.raises(TrainError, match=message):
        plan_resume(s, index, MAIN, dp_size=2, elastic=True, fetch_weights=None)


def test_at_a_thousand_classes_an_evaluation_row_keeps_its_scalars_and_the_confusion_plot_stays_small(
    tmp_path: Path,
) -> None:
    import matplotlib.image
    import numpy as np

    from clipforge.rundir import RunDir
    from clipforge.rundir.plots import plot_run

    classes = [f"class {i}" for i in range(1000)]
    confusion = np.diag(np.arange(1000) % 5).tolist()
    per_class = dict.fromkeys(classes, 0.5)
    run = RunDir(tmp_path / "run")
    run.append_metrics({"kind": "train", "step": 1, "loss": 2.0})
    run.append_metrics(
        {
            "kind": "eval",
            "step": 1,
            "split": "val",
            "loss": 1.0,
            "clip_top1": 0.5,
            "video_top1": 0.5,
            "confusion": confusion,
            "per_class_accuracy": per_class,
        }
    )
    (row,) = run.metrics("eval")
    assert row == {"kind": "eval", "step": 1, "split": "val", "loss": 1.0, "clip_top1": 0.5, "video_top1": 0.5}
    assert (tmp_path / "run" / "metrics.jsonl").stat().st_size < 1000  # 2.9 MiB with the matrix
    paths = plot_run(run.metrics(), classes, tmp_path / "plots", confusion)
    assert [p.name for p in paths] == ["curves.png", "confusion.png"]
    height, width, _ = matplotlib.image.imread(paths[1]).shape
    assert height <= 1100 and width <= 1100  # sized by the class count it was 60100 px square


# -- sizes past the suite's -----------------------------------------------------------------


def test_secagg_masks_each_client_with_log_n_neighbours_in_a_large_federation() -> None:
    """Flower's workflow takes the bounded neighbourhood; small federations keep every client a neighbour."""
    from clipforge.ps.fit_workflows import secagg_shares, secagg_workflow

    assert [secagg_shares(n) for n in (2, 4, 10)] == [1.0, 1.0, 1.0]
    assert [round(secagg_shares(n) * n) for n in (16, 50, 1000)] == [9, 13, 21]
    workflow = secagg_workflow(50, 0.0, 8.0, 2**22, 1000.0, 600.0)
    assert workflow.num_shares == secagg_shares(50) and workflow.reconstruction_threshold == 1.0
    # A share: applied by Flower to the clients a round actually sampled (30 of the 50 planned: 9, made odd).
    assert round(secagg_shares(50) * 30) | 1 == 9


def test_packing_names_a_few_skipped_files_per_reason_and_counts_the_rest(caplog) -> None:
    from clipforge.preprocess.pack import SKIPPED_SHOWN, _log_skipped

    skipped = [(f"a/{i}.jpg", "extension .jpg is not a video extension") for i in range(100_000)]
    skipped += [("b/notes.txt", "extension .txt is not a video extension")]
    with caplog.at_level("WARNING", logger="clipforge.preprocess.pack"):
        _log_skipped(skipped)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == SKIPPED_SHOWN + 2, lines
    assert f"not packed: {100_000 - SKIPPED_SHOWN} more files: extension .jpg" in lines[SKIPPED_SHOWN]
    assert lines[-1] == "not packed: b/notes.txt: extension .txt is not a video extension"


def test_ranks_that_score_whole_videos_add_up_to_one_process_at_a_thousand_classes() -> None:
    """Each rank keeps a tally of its own videos (hits, loss, confusion), never the split's logits."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from clipforge.inference.evaluation import Tally, evaluate_logits, videos_of_rank

    rng = np.random.default_rng(0)
    clips, classes = 3000, [str(c) for c in range(1000)]
    logits = (rng.normal(size=(clips, 1000)) * 3).astype(np.float32)
    labels, videos = rng.integers(0, 1000, clips), rng.integers(0, 700, clips)
    one = evaluate_logits(logits, labels, videos, classes)
    assert one["loss"] == pytest.approx(F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels)).item())
    total = Tally(1000)
    shares = [videos_of_rank(videos, rank, 3) for rank in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(clips))
    for mine in shares:
        assert not set(videos[mine]) & set(videos[np.setdiff1d(np.arange(clips), mine)])  # whole videos a rank
        part = Tally(1000)
        part.add_logits(logits[mine], labels[mine], videos[mine])
        total.merge(part)
    three = total.metrics(classes)
    assert three["confusion"] == one["confusion"] and three["videos"] == one["videos"] == len(set(videos))
    for key in ("clip_top1", "clip_top5", "video_top1", "video_top5", "loss"):
        assert three[key] == pytest.approx(one[key], abs=1e-9), key


def test_the_federation_watchdog_waits_while_the_server_beats_and_ignores_an_old_beat(tmp_path: Path) -> None:
    import os
    import time

    from clipforge.ps.flower import Watchdog

    beat = tmp_path / "heartbeat"
    beat.touch()
    os.utime(beat, (time.time() - 3600, time.time() - 3600))  # a previous start's last beat
    watch = Watchdog(beat, stall_s=0.3)
    for _ in range(4):  # 0.8 s in all, longer than the allowance, but beating
        time.sleep(0.2)
        assert not watch.stalled()
        beat.touch()
    time.sleep(0.4)
    assert watch.stalled()


def test_a_parameter_server_takes_back_a_trainer_it_dropped_as_silent_but_not_one_that_finished() -> None:
    import time

    import torch

    from clipforge.ps.server import ServerSettings, ShardServer

    settings = ServerSettings(mode="ssp", trainer_timeout_s=0.2)
    server = ShardServer(0, {"w": torch.zeros(3)}, ["trainer0", "trainer1"], settings, None)
    try:
        deadline = time.monotonic() + 10
        while "trainer0" in server.live and time.monotonic() < deadline:
            server.pull("trainer1")  # trainer 0 is silent (a long probe); trainer 1 is not
            time.sleep(0.05)
        assert server.live == {"trainer1"}
        server.push("trainer0", {"w": torch.ones(3)}, 1, 0).wait()
        assert server.live == {"trainer0", "trainer1"} and server.clocks["trainer0"] == 1
        server.leave("trainer1")
        server.pull("trainer1")  # a finished trainer's late word does not hold the others back again
        assert server.live == {"trainer0"}
    finally:
        server.finished.set()


def test_the_rounds_a_privacy_budget_allows_are_found_by_bisection_as_a_scan_finds_them(caplog) -> None:
    from clipforge.ps import privacy

    scan = max((r for r in range(13) if privacy.epsilon(1.1, 0.5, r, 1e-5) <= 8.0), default=0)
    assert 0 < scan < 12 and privacy.rounds_within(8.0, 1.1, 0.5, 12, 1e-5) == scan
    assert privacy.rounds_within(1e6, 1.1, 0.5, 12, 1e-5) == 12 and privacy.rounds_within(1e-3, 1.1, 0.5, 12, 1e-5) == 0
    assert "failed to converge" not in caplog.text  # the accountant's five lines a call, left out of the log


def test_a_rank_with_fewer_clips_runs_as_many_forward_passes_as_the_busiest_and_discards_the_extra() -> None:
    """Under ZeRO-3 every forward pass gathers the weights from all ranks: a rank that stopped early would leave
    the others waiting. Whole videos a rank make the shares uneven (here 3 clips against the busiest's 3 batches)."""
    import torch

    from clipforge.inference.evaluation import score

    class Clips(torch.utils.data.Dataset):
        classes = ["a", "b"]

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            return torch.full((2, 4, 4, 3), i, dtype=torch.uint8), i % 2

    seen: list[int] = []

    def forward(clips: torch.Tensor) -> torch.Tensor:
        seen.append(len(clips))
        return clips.float().mean(dim=(1, 2, 3, 4))[:, None].repeat(1, 2)

    logits, labels = score(forward, Clips(), [0, 1, 2], 2, None, batches=3)
    assert seen == [2, 1, 1] and logits.shape == (3, 2) and labels.tolist() == [0, 1, 0]
    seen.clear()
    logits, labels = score(forward, Clips(), [], 2, None, batches=2)  # a rank with no video at all
    assert seen == [1, 1] and logits.shape == (0, 2)
