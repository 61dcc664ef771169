#!/usr/bin/env python3
"""Benchmark of federated training on Flower: seconds and bytes per round, and accuracy under a privacy budget.

    python jobs/bench/fl.py [--clients 4 16] [--rounds 3] [--repeats 2] [--accuracy-rounds 20]

Packs a small motion corpus, then for each client count runs whole federations
(``jobs/fl_train.py``: a SuperLink with TLS, one authenticated SuperNode per
client, all on this host) with plain FedAvg, FedAvg with bf16 updates, SecAgg+,
client-level DP and DP-SGD on the clients (Opacus). (The RPC federated averaging that ``ps_train.py --algorithm
fedavg`` ran before was measured beside them before it went; the README keeps
those figures.) The sides alternate, each repeat in the
opposite order. A round's time is the time between two consecutive rounds'
rows in ``metrics.jsonl`` (the first round, which includes start-up, is not
counted); its bytes are what the clients' sockets to the server carried, read
from the kernel's TCP counters (``ss``), against the floor of the weights sent
down and up once per client in fp32.

Then accuracy on clients that each hold two of the six classes (non-IID), with
the demo's model and clips (16 frames of 64x64, cropped to 48): FedAvg and
FedProx over several seeds (the seed sets the model's start, the partition
and the shuffling), beside client 0 trained alone on its own share for as many
epochs, and, on the first seed, FedAvg with bf16 updates and with the noise
that spends epsilon 8 and 2. Video top-1 on the validation videos is noisy at
this size, so the accuracy corpus holds more validation videos than training
ones (78 against 42 by default), each run is scored by the mean of its last
four rounds' top-1 as well as its final one, and FedProx against FedAvg by the
median of their paired differences over the seeds.

The robust part (``--parts robust``) runs the aggregation rules side by side
on 5 honest IID clients: FedAvg, the trimmed mean, the median and Krum, the
sides alternating over seeds, each one's seconds per round and final and
last-four top-1 beside FedAvg's as paired ratios and differences: what
robustness to hostile clients costs when there are none.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tyro

from clipforge.hpc.distenv import free_port
from clipforge.hpc.mpi import mpiexec_command
from clipforge.preprocess import synthetic
from clipforge.rundir import RunDir

MODEL = ["--model.name", "videovit-tiny", "--model.depth", "2", "--model.tubelet", "2", "8", "8"]


@dataclasses.dataclass
class Config:
    """Flower FedAvg, bf16 updates, SecAgg+ and DP side by side, and accuracy at a privacy budget."""

    clients: list[int] = dataclasses.field(default_factory=lambda: [4, 16])
    """Client counts to time (the clients share this host's cores)."""
    rounds: int = 3
    """Rounds per timed federation (the first is not counted)."""
    repeats: int = 2
    """Federations per side and client count, alternating the order."""
    accuracy_rounds: int = 20
    """Rounds of the non-IID accuracy comparison (3 clients, two classes each; 0: none)."""
    accuracy_epochs: int = 1
    """Local epochs per round in the accuracy comparison."""
    accuracy_seeds: int = 2
    """Seeds of FedAvg, FedProx and the client alone in the accuracy comparison."""
    epsilons: list[float] = dataclasses.field(default_factory=lambda: [8.0, 2.0])
    """Privacy budgets of the accuracy comparison (epsilon at delta 1e-5), on the first seed."""
    proximal_mu: float = 10.0
    """FedProx's mu in the accuracy comparison."""
    accuracy_bf16: bool = True
    """Add FedAvg with bf16 updates to the accuracy comparison, on the first seed."""
    accuracy_videos_per_class: int = 20
    """Videos of each motion class in the accuracy comparison's corpus."""
    parts: list[str] = dataclasses.field(default_factory=lambda: ["timing", "accuracy"])
    """Which parts to run: timing, accuracy, robust (the aggregation rules)."""
    robust_rounds: int = 6
    """Rounds of each federation in the robust part (5 IID clients, one local epoch each)."""
    robust_seeds: int = 2
    """Seeds (paired federations) per aggregation rule in the robust part."""
    accuracy_train_share: float = 0.35
    """The share of them the clients train on; the rest are the validation videos (the defaults: 7 training
    videos a class, 42 in all, and 78 validation videos, so one video is 0.013 of top-1)."""


ACCURACY_MODEL = ["--model.name", "videovit-tiny", "--model.depth", "4", "--model.tubelet", "4", "16", "16"]
"""The demo's model, which learns the synthetic motions on these cores; with 48x48 crops of 64x64 clips."""
ACCURACY_TRAINING = [*ACCURACY_MODEL, "--data.crop", "48", "--batch-per-rank", "8", "--lr", "0.001"]


class WireCounter:
    """Bytes the chosen processes' TCP connections carried, from ``ss``'s per-socket counters, sampled in a thread.

    ``owns(pid, peer_port)`` picks the sockets; each socket's largest counters seen count once.
    """

    def __init__(self, owns) -> None:
        self.owns, self.seen, self.stop = owns, {}, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.read()
            time.sleep(0.2)

    def read(self) -> None:
        lines = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout.splitlines()
        for head, info in zip(lines, lines[1:] + [""]):
            if head[:1].isspace():
                continue  # an info line: read with its socket's line
            fields = head.split()
            pid = re.search(r"pid=(\d+)", head)
            if len(fields) < 5 or pid is None or not self.owns(int(pid.group(1)), int(fields[4].rsplit(":", 1)[1])):
                continue
            counts = dict(re.findall(r"(bytes_acked|bytes_received):(\d+)", info))
            key = (fields[3], fields[4])
            old = self.seen.get(key, (0, 0))
            self.seen[key] = (
                max(old[0], int(counts.get("bytes_acked", 0))),
                max(old[1], int(counts.get("bytes_received", 0))),
            )

    def total(self) -> int:
        self.stop.set()
        self.thread.join()
        return sum(a + b for a, b in self.seen.values())


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class RoundClock:
    """When each round's row appeared in a run directory's metrics."""

    def __init__(self, run: RunDir, kind: str) -> None:
        self.run, self.kind, self.times, self.stop = run, kind, {}, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            for row in self.run.metrics(self.kind):
                self.times.setdefault(row["step"], time.perf_counter())
            time.sleep(0.05)

    def seconds_per_round(self) -> float:
        self.stop.set()
        self.thread.join()
        steps = sorted(self.times)
        return statistics.median(self.times[b] - self.times[a] for a, b in zip(steps, steps[1:]))


def flower(store: Path, run: Path, clients: int, rounds: int, *extra: str) -> dict:
    """A whole federation on this host: its seconds per round, bytes per round, final top-1 and the mean top-1 of
    its last four rounds. ``extra`` flags win over the tiny model's."""
    port = free_port()
    argv = [sys.executable, "-m", "clipforge.jobs.fl_train", "--data.store", str(store), "--run-dir", str(run)]
    argv += ["--executor", "debug", "--clients", str(clients), "--rounds", str(rounds), "--port", str(port)]
    argv += [*MODEL, "--batch-per-rank", "4", *extra]
    clock = RoundClock(RunDir(run), "round")
    wire = WireCounter(lambda pid, peer: peer == port and "flower-supernode" in cmdline(pid))
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"flower {' '.join(extra)} failed:\n{result.stderr[-2000:]}")
    rows = RunDir(run).metrics()
    last = [r["video_top1"] for r in rows if r["kind"] == "round" and "video_top1" in r][-4:]
    final = next(r["video_top1"] for r in reversed(rows) if r["kind"] == "eval")
    return {"s": clock.seconds_per_round(), "bytes": wire.total() / rounds, "top1": final, "last4": mean(last)}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def weight_bytes(store: Path) -> int:
    from clipforge.models.builders import architecture
    from clipforge.preprocess.store import ClipStore

    s = ClipStore.open(store)
    arch = architecture(
        "videovit-tiny", len(s.classes), s.params["clip_frames"], s.params["height"], depth=2, tubelet=(2, 8, 8)
    )
    return sum(v.numel() * 4 for v in arch.build(seed=0).state_dict().values())


def alone(store: Path, epochs: int, seed: int) -> dict:
    """Client 0 of 3 (by class: two of the six classes) trained alone on its own share, one epoch at a time as a
    client's round trains: its final top-1 and the mean top-1 of its last four epochs."""
    from clipforge.inference.evaluation import evaluate_model
    from clipforge.models.builders import architecture
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.preprocess.store import ClipStore
    from clipforge.ps.federated import train_locally
    from clipforge.ps.worker import Augment, partition

    s = ClipStore.open(store)
    model = architecture(
        "videovit-tiny", len(s.classes), s.params["clip_frames"], 48, depth=4, tubelet=(4, 16, 16)
    ).build(seed=seed)
    train, val = ClipDataset(s, "train"), ClipDataset(s, "val")
    share = partition(train.labels, 3, "by_class", seed)[0]
    scores = []
    for e in range(epochs):
        train_locally(model, train, share, 1, 0.001, 8, e, Augment(48, True, seed * 1009))
        scores.append(evaluate_model(model, val, 8, 48)["video_top1"])
    return {"top1": scores[-1], "last4": mean(scores[-4:])}


def pack(
    work: Path,
    folder: str = "store",
    frames: int = 8,
    size: int = 32,
    stride: int = 1,
    videos_per_class: int = 10,
    train_share: float = 0.7,
) -> Path:
    """A store of the motion corpus (``videos_per_class`` of each class), ``train_share`` of it training videos
    and the rest validation videos."""
    videos = work / f"videos-{videos_per_class}"
    if not videos.exists():
        synthetic.make_corpus(videos, videos_per_class=videos_per_class, frames=(48, 64), seed=2)
    argv = [*mpiexec_command(2), sys.executable, "-m", "clipforge.jobs.preprocess", "--videos", str(videos)]
    argv += ["--out", str(work / folder), "--clip-frames", str(frames), "--frame-stride", str(stride)]
    argv += ["--height", str(size), "--width", str(size)]
    argv += ["--split.train", str(train_share), "--split.val", f"{1 - train_share:g}", "--split.test", "0"]
    subprocess.run(argv, check=True, capture_output=True)
    return work / folder


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f}x {min(values):5.2f}-{max(values):.2f}x"


def timing(cfg: Config, work: Path) -> None:
    """Seconds and bytes per round of each side at each client count."""
    store = pack(work)
    floor = weight_bytes(store)
    sides = {
        "Flower FedAvg": lambda k, run: flower(store, run, k, cfg.rounds),
        "Flower FedAvg bf16": lambda k, run: flower(store, run, k, cfg.rounds, "--transport", "bf16"),
        "Flower SecAgg+": lambda k, run: flower(store, run, k, cfg.rounds, "--secagg"),
        "Flower DP (z=1)": lambda k, run: flower(store, run, k, cfg.rounds, "--dp.noise-multiplier", "1.0"),
        "Flower DP-SGD (z=1)": lambda k, run: flower(store, run, k, cfg.rounds, "--dp.sample-noise-multiplier", "1"),
    }
    timed: dict[int, dict[str, list[dict]]] = {}
    for k in cfg.clients:
        timed[k] = {name: [] for name in sides}
        for r in range(cfg.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                print(f"  {k} clients, repeat {r + 1}: {name}", file=sys.stderr, flush=True)
                got = sides[name](k, work / f"{k}-{r}-{list(sides).index(name)}")
                timed[k][name].append(got)
                line = f"    {got['s']:.2f} s/round, {got['bytes'] / 2**20:.2f} MiB/round, top-1 {got['top1']:.3f}"
                print(line, file=sys.stderr, flush=True)
    print(
        f"\nvideovit-tiny (depth 2, {floor / 2**20:.2f} MiB of fp32 weights), {cfg.rounds} rounds per federation, "
        f"{cfg.repeats} federations per side in alternating order; a round: 1 local epoch of every client, then "
        "the server's evaluation\n"
    )
    print(
        f"{'clients':>7}  {'side':<20} {'s/round':>8} {'vs FedAvg':>16} {'MiB/round':>10} {'vs floor':>9}"
        f" {'vs FedAvg':>16}"
    )
    for k, by_side in timed.items():
        base = by_side["Flower FedAvg"]
        for name, runs in by_side.items():
            s = statistics.median(r["s"] for r in runs)
            vs_s = spread([r["s"] / f["s"] for r, f in zip(runs, base)]) if name != "Flower FedAvg" else ""
            b = statistics.median(r["bytes"] for r in runs)
            vs_b = spread([r["bytes"] / f["bytes"] for r, f in zip(runs, base)]) if name != "Flower FedAvg" else ""
            print(f"{k:>7}  {name:<20} {s:8.2f} {vs_s:>16} {b / 2**20:10.2f} {b / (2 * k * floor):8.2f}x {vs_b:>16}")
    print(f"\nfloor: the fp32 weights down and up once per client a round ({2 * floor / 2**20:.2f} MiB a client)")
    print("goal: SecAgg+ and DP within 2x of FedAvg's round; bf16 about 0.75x of its bytes (half of the upload)")
    print("DP-SGD's round costs what Opacus's per-clip gradients cost the clients' training, at the same bytes")


def accuracy(cfg: Config, work: Path) -> None:
    """Non-IID accuracy of FedAvg and FedProx over seeds, beside a client alone; bf16 and DP on the first seed."""
    from clipforge.preprocess.reader import ClipDataset

    n, e = cfg.accuracy_rounds, cfg.accuracy_epochs
    clips = pack(work, "accuracy-store", 16, 64, 2, cfg.accuracy_videos_per_class, cfg.accuracy_train_share)
    videos = len(set(ClipDataset(clips, "val").video_ids.tolist()))
    shares = ["--shares", "by_class", "--local-epochs", str(e), *ACCURACY_TRAINING]
    print(
        f"\nnon-IID (3 clients, 2 of the 6 classes each; videovit-tiny depth 4, 16x48x48 clips): video top-1 on "
        f"{videos} validation videos after {n} rounds of {e} local epoch(s); last 4: the mean of the last four "
        "rounds\n"
    )
    sides = {"FedAvg": [], f"FedProx mu {cfg.proximal_mu:g}": ["--proximal-mu", str(cfg.proximal_mu)]}
    scored: dict[str, list[dict]] = {name: [] for name in sides}
    scored[f"client 0 alone, {n * e} epochs"] = []
    for seed in range(cfg.accuracy_seeds):
        order = list(sides) if seed % 2 == 0 else list(reversed(sides))
        for name in order:
            print(f"  accuracy, seed {seed}: {name}", file=sys.stderr, flush=True)
            run = work / f"accuracy-{seed}-{list(sides).index(name)}"
            scored[name].append(flower(clips, run, 3, n, *shares, "--seed", str(seed), *sides[name]))
        scored[f"client 0 alone, {n * e} epochs"].append(alone(clips, n * e, seed))
    print(f"  {'side':<32} {'final, per seed':>22} {'last 4, per seed':>22} {'last 4 vs FedAvg':>24}")
    for name, runs in scored.items():
        final = " ".join(f"{r['top1']:.3f}" for r in runs)
        last = " ".join(f"{r['last4']:.3f}" for r in runs)
        diffs = [r["last4"] - f["last4"] for r, f in zip(runs, scored["FedAvg"])]
        vs = f"{statistics.median(diffs):+.3f} ({min(diffs):+.3f} to {max(diffs):+.3f})" if name != "FedAvg" else ""
        print(f"  {name:<32} {final:>22} {last:>22} {vs:>24}")
    extras = [("FedAvg, bf16 transport", ["--transport", "bf16"])] if cfg.accuracy_bf16 else []
    for eps in cfg.epsilons:
        extras.append((f"FedAvg, epsilon {eps:g}", ["--dp.target-epsilon", str(eps), "--dp.clipping-norm", "1.0"]))
    for i, (name, extra) in enumerate(extras):
        print(f"  accuracy, seed 0: {name}", file=sys.stderr, flush=True)
        result = flower(clips, work / f"accuracy-extra-{i}", 3, n, *shares, "--seed", "0", *extra)
        print(f"  {name + ' (seed 0)':<32} {result['top1']:>22.3f} {result['last4']:>22.3f}")
    print(
        "\ngoal: FedProx at least FedAvg's accuracy, both above the client alone; the DP rows show what the "
        "budget costs at 3 clients"
    )


def robust(cfg: Config, work: Path) -> None:
    """The aggregation rules on 5 honest clients: each one's round time and accuracy against FedAvg's, paired."""
    n = cfg.robust_rounds
    clips = pack(work, "robust-store", 16, 64, 2, cfg.accuracy_videos_per_class, 0.5)
    rules = ["fedavg", "trimmed-mean", "median", "krum"]
    runs: dict[str, list[dict]] = {rule: [] for rule in rules}
    for seed in range(cfg.robust_seeds):
        for rule in rules if seed % 2 == 0 else list(reversed(rules)):
            print(f"  robust, seed {seed}: {rule}", file=sys.stderr, flush=True)
            run = work / f"robust-{seed}-{rule}"
            runs[rule].append(flower(clips, run, 5, n, *ACCURACY_TRAINING, "--seed", str(seed), "--aggregation", rule))
    print(
        f"\n--aggregation with 5 honest IID clients (videovit-tiny depth 4, 16x48x48 clips), {n} rounds of one local "
        f"epoch, {cfg.robust_seeds} seeds, the rules alternating in order; ratios and differences paired by seed\n"
    )
    print(f"  {'rule':<14} {'s/round':>8} {'vs FedAvg':>16} {'final top-1':>12} {'last 4':>8} {'last 4 vs FedAvg':>24}")
    base = runs["fedavg"]
    for rule, got in runs.items():
        s = statistics.median(r["s"] for r in got)
        vs_s = spread([r["s"] / f["s"] for r, f in zip(got, base)]) if rule != "fedavg" else ""
        diffs = [r["last4"] - f["last4"] for r, f in zip(got, base)]
        vs = f"{statistics.median(diffs):+.3f} ({min(diffs):+.3f} to {max(diffs):+.3f})" if rule != "fedavg" else ""
        final = statistics.median(r["top1"] for r in got)
        last = statistics.median(r["last4"] for r in got)
        print(f"  {rule:<14} {s:8.2f} {vs_s:>16} {final:12.3f} {last:8.3f} {vs:>24}")
    print(
        "\ngoal: the robust rules within 1.2x of FedAvg's round; their accuracy cost is the price of tolerating "
        "hostile clients (trimmed mean: up to 20% of them, median: under half, Krum: f of n > 2f + 2)"
    )


def main(cfg: Config) -> None:
    with tempfile.TemporaryDirectory(prefix="clipforge-bench-fl-") as tmp:
        work = Path(tmp)
        if cfg.clients and "timing" in cfg.parts:
            timing(cfg, work)
        if cfg.accuracy_rounds and "accuracy" in cfg.parts:
            accuracy(cfg, work)
        if "robust" in cfg.parts:
            robust(cfg, work)


if __name__ == "__main__":
    main(tyro.cli(Config))
