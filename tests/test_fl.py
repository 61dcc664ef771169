"""Federated training on Flower with real processes on this host: a SuperLink with TLS, authenticated SuperNodes."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from clipforge.base.errors import UserError
from clipforge.models.builders import architecture, create_model, load_weights
from clipforge.preprocess.store import ClipStore
from clipforge.ps import certs

from .federations import (
    DP_CLIP,
    DP_SIGMA,
    NON_IID_EPOCHS,
    NON_IID_LR,
    NON_IID_MU,
    ONE_ROUND,
    START_SEED,
)
from .federations import FL_TINY as TINY
from .helpers import tiny_start

pytestmark = pytest.mark.checks_early


@pytest.fixture(scope="module")
def one_round(early) -> dict[str, Path]:
    """One round of each variant (federations.ONE_ROUND), run while the rest of the suite ran."""
    return {name: early.result(name) for name in ONE_ROUND}


@pytest.fixture(scope="module")
def non_iid(early) -> dict[str, Path]:
    """One round of FedAvg and one of FedProx on 3 clients split by class, from the same start (run while the rest of
    the suite ran; federations.non_iid), and the store they ran on."""
    return early.result("non-iid")


@pytest.fixture(scope="module")
def resumed(slurm, tiny_store: Path, early) -> tuple[Path, list]:
    """A federation of 2 clients over 2 rounds in one local task, killed after its first round (while the rest of
    the suite ran), then started again as a Slurm job of 3 tasks: the server's and one per client; both evaluate
    every second round."""
    from clipforge.hpc.launch import run_script

    run = early.result("killed")
    where = ["--data.store", str(tiny_store), "--run-dir", str(run), "--clients", "2", "--rounds", "2", *TINY]
    where += ["--eval-every", "2"]
    return run, run_script(
        "clipforge.jobs.fl_train", ["--cluster", "dev", "--wait", "True", "--ntasks-per-node", "3", *where]
    )


def test_a_federation_killed_after_a_round_resumes_there_as_a_slurm_job_of_a_task_per_client(resumed) -> None:
    run, results = resumed
    assert len(results) == 3 and results[0]["rounds"] == 2 and results[1:] == [None, None]
    # The first start's certificate was for this host's loopback; the job's server re-issued it for its node.
    assert socket.gethostname().split(".")[0] in certs.server_hosts(run / "certs")
    logs = "".join(p.read_text() for p in (run / "flower" / "logs").glob("run-*.log"))
    assert "resuming the federation after round 1 of 2" in logs, logs[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["kind"] == "round"]
    assert [r["step"] for r in rounds] == [1, 2]  # round 1 once: its rerun did not happen
    assert "video_top1" not in rounds[0] and "video_top1" in rounds[1]  # --eval-every 2: the last round evaluated
    assert sorted(p.name for p in (run / "rounds").iterdir()) == ["round-00001.safetensors", "round-00002.safetensors"]
    # The final weights are the last round's global model, and load strictly into the plain model.
    model = create_model("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8))
    load_weights(model, run / "final" / "model.safetensors")
    last = load_file(str(run / "rounds" / "round-00002.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in last.items())
    record = json.loads((run / "final" / "run.json").read_text())
    assert record["steps"] == 2 and "video_top1" in record["metrics"] and record["slurm_job_id"]


def test_secagg_plus_gives_fedavg_of_the_clients_that_stayed_within_its_quantisation_error(one_round) -> None:
    from clipforge.ps.federated import FederatedPlan, _Client, round_config

    run = one_round["secagg"]
    logs = "".join(p.read_text() for p in (run / "flower" / "logs").glob("run-*.log"))
    assert "Secure aggregation completed" in logs, logs[-3000:]
    assert "sampled 4 clients" in logs and "aggregate_fit: received 3 results" in logs, logs[-3000:]
    secure = load_file(str(run / "final" / "model.safetensors"))
    # The same round in the clear, here: clients 0-2 train from the initial model, FedAvg weighs them by examples.
    plan = FederatedPlan.read(run / "flower" / "plan.json")
    store = ClipStore.open(Path(plan.store))
    start = architecture(plan.model, 6, 8, 32, **plan.overrides).build(seed=plan.seed).state_dict()
    config = round_config(plan, store, 1)
    node = {"store": plan.store, "num-partitions": 4, "partition": "iid", "seed": plan.seed}
    # With the threads the federation's four client processes had (their share of the cores: distenv.share_cores):
    # the last bits of an update depend on how many threads summed it.
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // 4)))
    try:
        answers = [
            _Client({**node, "partition-id": i}).fit([v.numpy() for v in start.values()], config) for i in range(3)
        ]
    finally:
        torch.set_num_threads(threads)
    total = sum(n for _, n, _ in answers)
    plain = {k: sum(w[j] * n for w, n, _ in answers) / total for j, k in enumerate(start)}
    # Each client's weighted update is clipped to [-c, c] and stochastically rounded to one of Q levels (an error
    # below one level, 2c/Q); the sum of k such errors is divided by the clients' total weight, total/max_weight.
    k, c, levels = 3, plan.secagg_clipping_range, plan.secagg_quantization_range
    bound = k * (2 * c / levels) * plan.secagg_max_weight / total
    largest = max(np.abs(v).max() for v in plain.values())
    worst = max(np.abs(secure[key].numpy() - plain[key]).max() for key in plain)
    assert 0 < worst <= bound + 4 * float(np.finfo(np.float32).eps) * largest, (worst, bound)


def test_client_level_dp_adds_the_configured_noise_and_reports_the_accountants_epsilon(resumed, one_round) -> None:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    run, sigma, clip, clients = one_round["dp"], DP_SIGMA, DP_CLIP, 2
    noised = load_file(str(run / "final" / "model.safetensors"))
    clear = load_file(str(resumed[0] / "rounds" / "round-00001.safetensors"))
    noise = torch.cat([(noised[k] - clear[k]).flatten() for k in clear])
    assert abs(noise.std().item() / (sigma * clip / clients) - 1) < 0.01 and abs(noise.mean().item()) < 1e-4
    row = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in line)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(sigma)))
    assert row["epsilon"] == accountant.get_epsilon(1e-5) and row["delta"] == 1e-5
    record = json.loads((run / "final" / "run.json").read_text())["federated"]
    assert record["differential_privacy"]["epsilon"] == row["epsilon"] and record["rounds"] == 1


def test_a_privacy_budget_stops_the_federation_at_its_last_round_within_it(tiny_store: Path) -> None:
    from clipforge.jobs import fl_train
    from clipforge.ps import federation, privacy

    base = ["--data.store", str(tiny_store), *TINY, "--rounds", "5", "--dp.noise-multiplier", "1.0"]
    target = (privacy.epsilon(1.0, 1.0, 2, 1e-5) + privacy.epsilon(1.0, 1.0, 3, 1e-5)) / 2  # between rounds 2 and 3
    cfg = fl_train.parse([*base, "--dp.target-epsilon", str(target)])
    fl_train.check(cfg)
    assert federation.plan(cfg).rounds == 2
    too_small = fl_train.parse([*base, "--dp.target-epsilon", "0.01"])
    with pytest.raises(federation.FederationError, match="one round already spends epsilon"):
        fl_train.check(too_small)
    # A budget alone: the least noise that spends it over all the rounds.
    alone = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--rounds", "5", "--dp.target-epsilon", "4"])
    z = federation.noise_multiplier(alone)
    assert privacy.epsilon(z, 1.0, 5, 1e-5) <= 4 < privacy.epsilon(0.99 * z, 1.0, 5, 1e-5)
    assert federation.plan(alone).rounds == 5 and federation.plan(alone).dp_noise_multiplier == z


def test_on_clients_split_by_class_fedprox_reaches_fedavg_and_both_beat_a_client_alone(non_iid) -> None:
    from clipforge.inference.evaluation import evaluate_model
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.ps.federated import train_locally
    from clipforge.ps.worker import Augment, partition

    weights = non_iid["start"] / "final" / "model.safetensors"
    top1 = {}
    for side in ("fedavg", "fedprox"):
        rows = [json.loads(line) for line in (non_iid[side] / "metrics.jsonl").read_text().splitlines()]
        top1[side] = [row["video_top1"] for row in rows if row["kind"] == "round"][-1]
    # Client 0 alone: its share (2 of the 6 classes), trained from the same start as its SuperNode trained it in
    # the FedAvg round (the same seeds), then scored on the same validation videos as the federations.
    store = ClipStore.open(non_iid["store"])
    train, val = ClipDataset(store, "train"), ClipDataset(store, "val")
    model = create_model("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8))
    load_weights(model, weights)
    share = partition(train.labels, 3, "by_class", seed=0)[0]
    train_locally(
        model, train, share, NON_IID_EPOCHS, NON_IID_LR, batch=4, round_index=1, augment=Augment(None, False, 0)
    )
    alone = evaluate_model(model, val, 4, None)["video_top1"]
    # In-process trials of this round (the clients' own training and weighting, without Flower) on 16 seeds of
    # start, partition and shuffling: FedProx above FedAvg by 0.06-0.40 and FedAvg above the client alone by
    # 0.03-0.35 on every seed (README, "Federated training"). Here, with Flower: 0.639, 0.500 and 0.194.
    assert top1["fedprox"] >= top1["fedavg"] > alone, (top1, alone)
    # FedProx got there by keeping its clients near the round's start: its global model moved far less.
    start = load_file(str(weights))

    def moved(run: Path) -> float:
        final = load_file(str(run / "final" / "model.safetensors"))
        return torch.cat([(final[k] - start[k]).flatten() for k in start]).norm().item()

    assert 0 < moved(non_iid["fedprox"]) < 0.5 * moved(non_iid["fedavg"])
    record = json.loads((non_iid["fedprox"] / "final" / "run.json").read_text())
    assert record["federated"]["strategy"] == f"FedProx (mu {NON_IID_MU})"


def test_a_federation_starts_from_downloaded_weights_and_a_finished_run_brings_its_architecture(
    tiny_store: Path, one_round
) -> None:
    from clipforge.jobs import fl_train
    from clipforge.models.builders import ModelError

    run = one_round["start"]
    start = tiny_start(START_SEED).state_dict()
    final = load_file(str(run / "final" / "model.safetensors"))

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return torch.cat([(a[k] - b[k]).flatten() for k in start]).norm().item()

    # One round of one client moved the global model from the file's weights (by about a third of the distance
    # between two initialisations), not from the seed's own.
    assert 0 < distance(final, start) < 0.5 * distance(final, tiny_start().state_dict())
    logs = "".join(p.read_text() for p in (run / "flower" / "logs").glob("run-*.log"))
    assert f"starting the federation from {run.parent / 'start.safetensors'}" in logs, logs[-3000:]
    assert json.loads((run / "final" / "run.json").read_text())["federated"]["start"].endswith("start.safetensors")
    # A finished run (this federation's) brings its architecture: no model flags needed, and they match.
    cfg = fl_train.parse(["--data.store", str(tiny_store), "--model.weights", str(run)])
    fl_train.check(cfg)
    assert (cfg.model.name, cfg.model.depth, cfg.model.tubelet) == ("videovit-tiny", 2, (2, 8, 8))
    assert cfg.model.weights == run / "final" / "model.safetensors"
    # Weights that do not fit the model asked for, or no weights there, are refused in one line before anything.
    other = fl_train.parse(
        [
            "--data.store",
            str(tiny_store),
            *TINY,
            "--model.depth",
            "1",
            "--model.weights",
            str(run.parent / "start.safetensors"),
        ]
    )
    with pytest.raises(ModelError, match="start.safetensors does not fit the model"):
        fl_train.check(other)
    missing = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--model.weights", str(run / "nothing")])
    with pytest.raises(UserError, match="--model.weights .*nothing: no such file or folder"):
        fl_train.check(missing)


def test_a_task_count_that_is_neither_one_nor_one_per_client_is_refused(tiny_store: Path) -> None:
    from clipforge.jobs import fl_train
    from clipforge.ps import federation

    cfg = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--clients", "3", "--nodes", "2"])
    with pytest.raises(federation.FederationError, match="2 tasks for 3 clients.*--nodes 4 --ntasks-per-node 1"):
        fl_train.check(cfg)


def test_a_proximal_pull_past_the_global_model_is_refused(tiny_store: Path) -> None:
    from clipforge.jobs import fl_train
    from clipforge.ps import federation

    cfg = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--lr", "0.01", "--proximal-mu", "200"])
    with pytest.raises(federation.FederationError, match="--proximal-mu 200 with --lr 0.01.*--proximal-mu 100 or less"):
        fl_train.check(cfg)


def test_bf16_transport_gives_fedavgs_round_within_its_rounding(resumed, one_round) -> None:
    run = one_round["bf16"]
    start = tiny_start().state_dict()
    half = load_file(str(run / "final" / "model.safetensors"))
    full = load_file(str(resumed[0] / "rounds" / "round-00001.safetensors"))  # the same round in fp32
    change = torch.cat([(full[k] - start[k]).flatten() for k in start])
    error = torch.cat([(half[k] - full[k]).flatten() for k in start])
    # Each client's change is rounded to bf16 (relative error 2^-8 at most); their average errs by about that.
    assert 0 < error.norm() < 2**-8 * change.norm(), (error.norm(), change.norm())
    assert json.loads((run / "final" / "run.json").read_text())["federated"]["transport"] == "bf16"


@pytest.mark.parametrize("transport", ["bf16", "fp16"])
def test_a_half_precision_update_decodes_to_the_weights_within_its_rounding(transport: str) -> None:
    from clipforge.ps.transport import decode, encode

    g = np.random.default_rng(0)
    start = g.standard_normal(10_000).astype(np.float32)
    weights = start + 1e-3 * g.standard_normal(10_000).astype(np.float32)
    sent = encode(weights, start, transport)
    assert sent.itemsize == 2 and encode(np.arange(3), np.arange(3), transport).dtype == np.arange(3).dtype
    back = decode(sent, start, transport)
    unit = 2**-8 if transport == "bf16" else 2**-11
    assert back.dtype == np.float32 and np.all(np.abs(back - weights) <= unit * np.abs(weights - start) + 1e-6)


def test_dp_sgd_steps_on_poisson_samples_of_a_share_empty_ones_included(tiny_store: Path) -> None:
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.ps import dpsgd
    from clipforge.ps.federated import train_locally
    from clipforge.ps.worker import Augment

    dataset = ClipDataset(ClipStore.open(tiny_store), "train")
    share = np.arange(30)
    model = create_model("videovit-tiny", 6, 8, 32, depth=1, tubelet=(2, 8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    # Batch 1 of 30 clips: each step samples each clip with probability 1/30, so about a third of the 30 steps
    # draw no clip at all, and still step (on noise alone).
    spent = train_locally(model, dataset, share, 1, 1e-3, 1, 2, Augment(None, True, 0), 0.0, dpsgd.SampleDP(1, 1, 1e-5))
    assert spent == {"sample_epsilon": dpsgd.epsilon(1.0, 1 / 30, 2 * 30, 1e-5)}  # as if it took rounds 1 and 2
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_opacus_per_clip_gradients_of_videovit_are_autograds_for_each_clip_alone(pool: str) -> None:
    from opacus import GradSampleModule

    from clipforge.ps import dpsgd

    dpsgd.register_videovit()
    torch.manual_seed(0)
    model = create_model("videovit-tiny", 6, 8, 32, depth=2, tubelet=(2, 8, 8), pool=pool)
    clips, labels = torch.randint(0, 255, (3, 8, 32, 32, 3), dtype=torch.uint8), torch.tensor([0, 4, 5])
    loss = F.cross_entropy(GradSampleModule(model, strict=False, loss_reduction="sum")(clips), labels, reduction="sum")
    loss.backward()
    per_clip = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    for i in range(3):
        model.zero_grad()
        F.cross_entropy(model(clips[i : i + 1]), labels[i : i + 1]).backward()
        for n, p in model.named_parameters():
            assert torch.allclose(per_clip[n][i], p.grad, rtol=1e-4, atol=1e-6), n


def test_dp_sgd_with_a_batchnorm_model_is_refused_in_one_line(tiny_store: Path) -> None:
    from clipforge.jobs import fl_train
    from clipforge.ps import federation

    argv = ["--data.store", str(tiny_store), "--model.name", "r2plus1d_18", "--dp.sample-noise-multiplier", "1"]
    with pytest.raises(federation.FederationError, match="Opacus cannot train it with DP-SGD .BatchNorm.*videovit"):
        fl_train.check(fl_train.parse(argv))
