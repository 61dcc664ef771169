"""The main job on the embedded default: what ``clipforge demo`` runs.

With no cluster it runs on submitit's local executor, on a small corpus made
here; ``--cluster dev`` runs the same stages as Slurm jobs on the local
single-node cluster. Every stage is skipped or resumed when its output is
already there, so a rerun does only what is missing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from clipforge.hpc.launch import run_script
from clipforge.jobs import evaluate
from clipforge.preprocess import synthetic
from clipforge.registry.repo import Ref, Registry, sha256
from clipforge.preprocess.store import ClipStore

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
    run_script("clipforge.jobs.preprocess", [*where, "--ntasks-per-node", "2", "--wait", "True", "--videos", str(videos),
                                             "--out", str(store), "--clip-frames", "16", "--frame-stride", "2",
                                             "--height", "64", "--width", "64", "--clips-per-video", "4",
                                             "--split.train", "0.7", "--split.val", "0.15", "--split.test", "0.15"])  # fmt: skip
    opened = ClipStore.open(store)
    errors = (store / "errors.jsonl").read_text().splitlines()

    log.info("stage 3/%d: train a tiny video transformer with DeepSpeed ZeRO-2 on 2 ranks", stages)
    run = workdir / "run"
    if not (run / "final" / "run.json").exists():
        run_script("clipforge.jobs.train", [*where, "--ntasks-per-node", "2", "--wait", "True", "--config", str(CONFIG),
                                            "--data.store", str(store), "--run-dir", str(run)])  # fmt: skip

    log.info("stage 4/%d: evaluate on the held-out test videos", stages)
    test = evaluate.main(evaluate.Config(run=run, split="test"))

    log.info("stage 5/%d: push the model into a registry (a bare Git LFS repository) and write its review", stages)
    remote = workdir / "registry.git"
    registry = Registry(str(remote)) if remote.exists() else Registry.init(str(remote))
    weights_sha = sha256(run / "final" / "model.safetensors")
    versions = registry.versions(MODEL_NAME).get(MODEL_NAME, [])
    ref = next((Ref(MODEL_NAME, v) for v in versions if registry.record(Ref(MODEL_NAME, v))["files"]["model.safetensors"]["sha256"] == weights_sha), None)
    if ref is None:
        ref = registry.push(run, MODEL_NAME)
    review = registry.review(ref, against="production")
    (workdir / "review.md").write_text(review)
    print(review)

    print()
    print(f"demo: OK in {time.time() - started:.0f} s")
    print(f"  self-test   2 ranks joined one process group (ranks from {results[0]['source']})")
    print(f"  corpus      {videos}  ({len(opened.videos['path'])} videos, {len(opened.classes)} classes, {len(errors)} in errors.jsonl)")
    print(f"  clip store  {store}  ({len(opened)} clips; train/val/test "
          f"{'/'.join(str(len(opened.splits[s])) for s in ('train', 'val', 'test'))})")  # fmt: skip
    print(f"  errors      {store / 'errors.jsonl'}: " + "; ".join(json.loads(e)["path"] for e in errors))
    print(f"  run         {run}  (config.yaml, metrics.jsonl, tensorboard/, checkpoints/, plots/)")
    print(f"  weights     {run / 'final' / 'model.safetensors'}")
    print(f"  registry    {remote}  ({ref}, branch {ref.branch}; `clipforge registry --remote {remote} list`)")
    print(f"  review      {workdir / 'review.md'}  (the pull-request body, printed above)")
    print(f"  test        video top-1 {test['video_top1']:.3f} on {test['videos']} videos (chance {1 / len(opened.classes):.3f}); "
          f"clip top-1 {test['clip_top1']:.3f}  ({run / 'eval-test.json'})")  # fmt: skip
    return 0
