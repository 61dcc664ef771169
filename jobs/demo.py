"""The main job on the embedded default: what ``clipforge demo`` runs.

With no cluster it runs on submitit's local executor, on a small corpus made
here; ``--cluster dev`` runs the same stages as Slurm jobs on the local
single-node cluster. Every stage is skipped or resumed when its output is
already there, so a rerun does only what is missing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from clipforge.base.files import sha256
from clipforge.hpc.launch import run_script
from clipforge.jobs import evaluate
from clipforge.preprocess import synthetic
from clipforge.preprocess.store import ClipStore, read_errors
from clipforge.registry.repo import Ref, Registry
from clipforge.rundir import RunDir

log = logging.getLogger("clipforge.demo")
CONFIG = Path(__file__).parent / "configs" / "demo_tiny.yaml"
MODEL_NAME = "demo-videovit-tiny"


def run(cluster: str | None = None, workdir: Path = Path("runs/demo")) -> int:
    started = time.time()
    os.environ.setdefault("CLIPFORGE_LOG_INTERVAL", "10")  # the jobs' progress lines, echoed here while they run
    workdir = Path(workdir).resolve()
    where = ["--cluster", cluster] if cluster else ["--executor", "local"]
    stages = 5

    log.info("stage 1/%d: cluster self-test, 2 ranks, gloo all_reduce", stages)
    results = run_script("clipforge.jobs.selftest", [*where, "--ntasks-per-node", "2", "--wait", "True"])
    if sorted(r["rank"] for r in results) != [0, 1] or any(r["all_reduce"] != 3.0 for r in results):
        print(f"demo: FAILED: the self-test ranks did not agree: {results}")
        return 1

    log.info("stage 2/%d: make a labelled corpus and pack it into a clip store with 2 MPI ranks", stages)
    videos, store = workdir / "videos", workdir / "store"
    if not (workdir / "videos.complete").exists():
        synthetic.make_corpus(videos, videos_per_class=12)
        synthetic.add_broken_files(videos, synthetic.CLASSES[0])
        (workdir / "videos.complete").write_text("")
    clip = ["--clip-frames", "16", "--frame-stride", "2", "--height", "64", "--width", "64", "--clips-per-video", "4"]
    split = ["--split.train", "0.7", "--split.val", "0.15", "--split.test", "0.15"]
    pack = ["--videos", str(videos), "--out", str(store), *clip, *split]
    run_script("clipforge.jobs.preprocess", [*where, "--ntasks-per-node", "2", "--wait", "True", *pack])
    opened = ClipStore.open(store)
    errors = read_errors(store)

    log.info("stage 3/%d: train a tiny video transformer with DeepSpeed ZeRO-2 on 2 ranks", stages)
    run = RunDir(workdir / "run")
    if not run.is_finished():
        train = ["--config", str(CONFIG), "--data.store", str(store), "--run-dir", str(run)]
        run_script("clipforge.jobs.train", [*where, "--ntasks-per-node", "2", "--wait", "True", *train])

    log.info("stage 4/%d: evaluate on the held-out test videos", stages)
    test = evaluate.main(evaluate.Config(run=run.root, split="test"))

    log.info("stage 5/%d: push the model into a registry (a bare Git LFS repository) and write its review", stages)
    remote = workdir / "registry.git"
    registry = Registry(str(remote)) if remote.exists() else Registry.init(str(remote))
    weights_sha = sha256(run.weights)
    versions = [Ref(MODEL_NAME, v) for v in registry.versions(MODEL_NAME).get(MODEL_NAME, [])]
    ref = next((r for r in versions if registry.record(r)["files"]["model.safetensors"]["sha256"] == weights_sha), None)
    if ref is None:
        ref = registry.push(run.root, MODEL_NAME)
    review = registry.review(ref, against="production")
    (workdir / "review.md").write_text(review)
    print(review)

    print()
    print(f"demo: OK in {time.time() - started:.0f} s")
    print(f"  self-test   2 ranks joined one process group (ranks from {results[0]['source']})")
    print(
        f"  corpus      {videos}  ({len(opened.videos['path'])} videos, {len(opened.classes)} classes, {len(errors)} "
        "left out)"
    )
    sizes = "/".join(str(len(opened.splits[s])) for s in ("train", "val", "test"))
    print(f"  clip store  {store}  ({len(opened)} clips; train/val/test {sizes})")
    print(f"  errors      {len(errors)} videos left out: " + "; ".join(e["path"] for e in errors))
    print(f"  run         {run}  ({', '.join(run.contents())})")
    print(f"  weights     {run.weights}")
    print(f"  registry    {remote}  ({ref}, branch {ref.branch}; `clipforge registry --remote {remote} list`)")
    print(f"  review      {workdir / 'review.md'}  (the pull-request body, printed above)")
    chance = 1 / len(opened.classes)
    print(
        f"  test        video top-1 {test['video_top1']:.3f} on {test['videos']} videos (chance {chance:.3f}); "
        f"clip top-1 {test['clip_top1']:.3f}  ({run.evaluation_path('test')})"
    )
    print(f"  next        federated training on shares of it: python jobs/fl_train.py --data.store {store} --clients 3")
    return 0
