"""Federated training on Flower: what the server and each client do in a round.

The server (a Flower ServerApp) holds the global model: it starts it from the
run directory's last round if there is one, samples only the nodes the job
registered, checks every update and weighs it by the examples the job assigned
its node (:mod:`guard`), has Flower's FedAvg (FedProx with a proximal mu, or a
robust aggregation) combine them, and after each round evaluates the global
model, checkpoints it into the run directory and writes the round's metrics.
The privacy accountant runs here, from the noise the server applied and the
rounds it ran: nothing a client reports enters an epsilon. A client (a Flower ClientApp on a SuperNode) builds the
same architecture from what the round's config names, loads the global
weights, trains on its own share of its own store and sends back its weights
and its number of examples. Weights travel as arrays (Flower's own records),
never as pickles.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from clipforge.hpc.distenv import dist_env
from clipforge.inference.evaluation import evaluate_model
from clipforge.models.builders import architecture, start_from
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.rundir import RunDir, RunRecord

from . import dpsgd, guard, privacy
from .fit_workflows import registered_only, secagg_workflow, timed_fit_workflow
from .transport import encode
from .worker import Augment, partition

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FederatedPlan:
    """What the server needs to run the federation; written by the job into the run directory."""

    run_dir: str
    store: str
    """The server's store: its classes and input shape, and the split it evaluates the global model on."""
    model: str
    overrides: dict[str, Any]
    rounds: int
    min_clients: int
    """Clients a round waits for (and samples at least)."""
    clients: int
    client_fraction: float
    local_epochs: int
    lr: float
    batch: int
    eval_split: str = "val"
    eval_every: int = 1
    """Rounds between evaluations of the global model on the eval split (and always after the last)."""
    crop: int | None = None
    flip: bool = False
    seed: int = 0
    keep_rounds: int = 2
    secagg: bool = False
    """Sum the updates under SecAgg+: the server learns only the sum of the clients' weighted updates."""
    secagg_clipping_range: float = 8.0
    """SecAgg+ clips every weight to [-range, range] before quantising it."""
    secagg_quantization_range: int = 2**22
    """SecAgg+ quantises [-clipping range, clipping range] into this many levels."""
    secagg_may_drop: float = 0.0
    """Share of a client's SecAgg+ neighbours (secagg_shares) that may drop after masking without stopping the round."""
    dp_noise_multiplier: float = 0.0
    """Client-level differential privacy: Gaussian noise of this many clipping norms on the sum of updates (0: off)."""
    dp_clipping_norm: float = 1.0
    """Each client's update (its weights minus the global ones) is clipped to this L2 norm."""
    dp_delta: float = 1e-5
    """The delta at which the accountant states epsilon."""
    dp_sgd_noise_multiplier: float = 0.0
    """Sample-level differential privacy: DP-SGD on every client through Opacus (0: off)."""
    dp_sgd_clipping_norm: float = 1.0
    """DP-SGD clips each clip's gradient to this L2 norm."""
    proximal_mu: float = 0.0
    """FedProx's mu: the weight of each client's proximal term (0: FedAvg)."""
    round_timeout_s: float = 600.0
    """How long a round waits for the sampled clients' answers before it goes on with those it has."""
    transport: Literal["fp32", "bf16", "fp16"] = "fp32"
    """How clients send their updates: fp32 weights, or their change from the global weights in bf16 or fp16."""
    secagg_max_weight: float = 1000.0
    """The largest example count a client may weigh its update by: SecAgg+ scales each update by its count over
    this before quantising, so it should be close to the largest client's count (the error grows with it)."""
    start_weights: str | None = None
    """The weights file the global model starts from (a published, imported or registry model, a finished run's),
    read by the server before round 1 only; None: the seed's initialisation."""
    start_source: str | None = None
    """Where the weights came from, for the record: ``registry:NAME@REF`` as given, or the local file."""
    nodes: dict[str, int] = dataclasses.field(default_factory=dict)
    """The node ids the job registered (Flower's, as strings) and the client each one is: no other is sampled."""
    examples: list[float] = dataclasses.field(default_factory=list)
    """The examples each client's update weighs by (by client index), as the job assigned them."""
    aggregation: guard.Aggregation = "fedavg"
    """How the checked updates are combined: FedAvg, or a robust aggregation for clients that may be hostile."""

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> FederatedPlan:
        return cls(**json.loads(Path(path).read_text()))


HEARTBEAT = Path("flower") / "heartbeat"
"""A file in the run directory that the ServerApp touches every :data:`HEARTBEAT_S` while it lives."""
HEARTBEAT_S = 10.0


def heartbeat(path: Path, stop: threading.Event) -> None:
    """Touch ``path`` until ``stop``: the job's watchdog (flower.Watchdog) tells a live ServerApp, however long
    its rounds and evaluations take, from one that died or hung."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while not stop.is_set():
        path.touch()
        stop.wait(HEARTBEAT_S)


def serve(grid, context) -> None:
    """The ServerApp's main: FedAvg over the SuperNodes for the plan's rounds, resuming after the last saved one."""
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow

    plan = FederatedPlan.read(Path(str(context.run_config["plan"])))
    run = RunDir(Path(plan.run_dir))
    store = ClipStore.open(Path(plan.store))
    frames, size = store.params["clip_frames"], plan.crop or store.params["height"]
    arch = architecture(plan.model, len(store.classes), frames, size, **plan.overrides)
    model = arch.build(seed=plan.seed)
    done, saved = run.last_round()
    if saved is not None:
        model.load_state_dict(saved)
        print(f"resuming the federation after round {done} of {plan.rounds}", flush=True)
    elif plan.start_weights is not None:
        fresh = start_from(model, Path(plan.start_weights))
        new_head = f"; classifier {', '.join(fresh)} new (other classes, or an encoder)" if fresh else ""
        copied = Path(str(plan.start_source)).resolve() != Path(plan.start_weights)  # a registry version's copy
        where = f"{plan.start_source} ({plan.start_weights})" if copied else plan.start_source
        print(f"starting the federation from {where}{new_head}", flush=True)
    keys = list(model.state_dict())
    eval_set = ClipDataset(store, plan.eval_split)
    started = time.time()
    evaluated: dict[int, dict[str, Any]] = {}
    """The global model's metrics by round, so the last round's evaluation is not run again for the record."""
    stop_beating = threading.Event()
    threading.Thread(target=heartbeat, args=(Path(plan.run_dir) / HEARTBEAT, stop_beating), daemon=True).start()

    refused: dict[int, list[str]] = {}
    """The nodes whose updates the checks refused, by round (:mod:`guard`)."""

    def after_round(server_round: int, arrays: list[np.ndarray], config: dict) -> tuple[float, dict] | None:
        if server_round == 0:
            return None  # the initial model: nothing trained yet
        finished = done + server_round
        state = {k: torch.from_numpy(np.array(a)) for k, a in zip(keys, arrays)}
        due = finished % plan.eval_every == 0 or finished == plan.rounds
        if due:
            model.load_state_dict(state)
            metrics = evaluated[finished] = evaluate_model(model, eval_set, plan.batch, plan.crop)
        run.save_round(finished, state, plan.keep_rounds)
        row = {"kind": "round", "step": finished}
        if due:
            row.update(loss=metrics["loss"], video_top1=metrics["video_top1"])
        if plan.dp_noise_multiplier > 0:
            row["epsilon"] = privacy.epsilon(plan.dp_noise_multiplier, plan.client_fraction, finished, plan.dp_delta)
            row["delta"] = plan.dp_delta
        if plan.dp_sgd_noise_multiplier > 0:
            row.update(sample_epsilon=sample_epsilon(plan, finished), delta=plan.dp_delta)
        if refused.get(server_round):
            row["refused"] = refused[server_round]
        run.append_metrics({**row, "seconds": time.time() - started})
        if not due:
            print(f"round {finished}/{plan.rounds}: saved (evaluated every {plan.eval_every} rounds)", flush=True)
            return None
        print(
            f"round {finished}/{plan.rounds}: {plan.eval_split} loss {metrics['loss']:.4f}, "
            f"video top-1 {metrics['video_top1']:.3f}",
            flush=True,
        )
        return float(metrics["loss"]), {"video_top1": float(metrics["video_top1"])}

    sampled = max(plan.min_clients, round(plan.client_fraction * plan.clients))  # as FedAvg samples
    if done < plan.rounds:
        strategy = guard.aggregator(
            plan.aggregation,
            plan.proximal_mu,
            plan.clients,
            fraction_fit=plan.client_fraction,
            fraction_evaluate=0.0,  # the server evaluates the global model on its own split
            min_fit_clients=plan.min_clients,
            min_available_clients=plan.min_clients,
            initial_parameters=ndarrays_to_parameters([v.numpy() for v in model.state_dict().values()]),
            evaluate_fn=after_round,
            on_fit_config_fn=lambda server_round: round_config(plan, store, done + server_round),
            fit_metrics_aggregation_fn=lambda results: {},  # what clients report enters no figure
        )
        if plan.dp_noise_multiplier > 0:
            from flwr.server.strategy import (
                DifferentialPrivacyClientSideFixedClipping,
                DifferentialPrivacyServerSideFixedClipping,
            )

            # Under SecAgg+ the server sees only the sum, so the clients clip (their mod) and it adds the noise;
            # otherwise the server clips each update itself: a client that skips its clipping gains nothing.
            central = (
                DifferentialPrivacyClientSideFixedClipping
                if plan.secagg
                else DifferentialPrivacyServerSideFixedClipping
            )
            strategy = central(strategy, plan.dp_noise_multiplier, plan.dp_clipping_norm, sampled)
        round_start: list[list[np.ndarray]] = [[]]

        def start_of_round(arrays: list[np.ndarray] | None = None) -> list[np.ndarray]:
            if arrays is not None:
                round_start[0] = arrays
            return round_start[0]

        # Under client-level DP every update weighs the same: its noise is calibrated to a mean of clipped updates.
        equal = plan.dp_noise_multiplier > 0
        strategy = guard.checked(
            strategy, start_of_round, plan.nodes, plan.examples, plan.transport, refused, plan.secagg, equal
        )
        rounds_left = ServerConfig(num_rounds=plan.rounds - done, round_timeout=plan.round_timeout_s)
        legacy = LegacyContext(context=context, config=rounds_left, strategy=strategy)
        if plan.secagg:
            fit = secagg_workflow(
                sampled,
                plan.secagg_may_drop,
                plan.secagg_clipping_range,
                plan.secagg_quantization_range,
                plan.secagg_max_weight,
                plan.round_timeout_s,
            )
        else:
            fit = timed_fit_workflow(plan.round_timeout_s)
        DefaultWorkflow(fit_workflow=fit)(registered_only(grid, set(plan.nodes)), legacy)
    rounds, state = run.last_round()
    model.load_state_dict(state)
    metrics = evaluated.get(rounds) or evaluate_model(model, eval_set, plan.batch, plan.crop)
    record = RunRecord.of_run(plan.model, plan.overrides, store, plan.crop, metrics, rounds, dist_env())
    record.federated = summary(plan, rounds)
    run.append_metrics({"kind": "eval", "step": rounds, **metrics})
    weights = run.write_final(state, record, metrics)
    print(f"federation finished after {rounds} rounds: video top-1 {metrics['video_top1']:.3f}; {weights}", flush=True)
    stop_beating.set()


def round_config(plan: FederatedPlan, store: ClipStore, round_index: int) -> dict[str, Any]:
    """What a client needs to build the model and train it in round ``round_index`` (Flower sends it with the
    weights)."""
    return {
        "round": round_index,
        "model": plan.model,
        "overrides": json.dumps(plan.overrides),
        "classes": len(store.classes),
        "frames": store.params["clip_frames"],
        "size": plan.crop or store.params["height"],
        "crop": plan.crop or 0,
        "flip": plan.flip,
        "epochs": plan.local_epochs,
        "lr": plan.lr,
        "batch": plan.batch,
        "seed": plan.seed,
        "proximal_mu": plan.proximal_mu,
        "transport": plan.transport,
        "dp_sgd_noise": plan.dp_sgd_noise_multiplier,
        "dp_sgd_clip": plan.dp_sgd_clipping_norm,
        "dp_delta": plan.dp_delta,
    }


def sample_epsilon(plan: FederatedPlan, rounds: int) -> float:
    """DP-SGD's epsilon after ``rounds``, the largest over the clients, from the shares the job assigned them and the
    noise it configured: the server's own account, whatever the clients report."""
    return max(
        dpsgd.share_epsilon(noise, int(clips), plan.batch, plan.local_epochs * rounds, plan.dp_delta)
        for noise, clips in ((plan.dp_sgd_noise_multiplier, n) for n in plan.examples)
    )


def summary(plan: FederatedPlan, rounds: int) -> dict[str, Any]:
    """The run record's account of the federation: engine, rounds, clients, aggregation and privacy."""
    out: dict[str, Any] = {
        "engine": "flower",
        "strategy": f"FedProx (mu {plan.proximal_mu:g})" if plan.proximal_mu > 0 else "FedAvg",
        "aggregation_rule": plan.aggregation,
        "rounds": rounds,
        "clients": plan.clients,
        "client_fraction": plan.client_fraction,
        "local_epochs": plan.local_epochs,
        "aggregation": "SecAgg+" if plan.secagg else "in the clear",
        "transport": plan.transport,
    }
    if plan.start_source is not None:
        out["start"] = plan.start_source
    if plan.dp_noise_multiplier > 0:
        out["differential_privacy"] = {
            "level": "client",
            "noise_multiplier": plan.dp_noise_multiplier,
            "clipping_norm": plan.dp_clipping_norm,
            "delta": plan.dp_delta,
            "epsilon": privacy.epsilon(plan.dp_noise_multiplier, plan.client_fraction, rounds, plan.dp_delta),
            "accountant": "RDP (dp-accounting), Poisson sampling at the client fraction, computed by the server",
            "clipping": "on the clients (SecAgg+ hides single updates)" if plan.secagg else "on the server",
        }
    if plan.dp_sgd_noise_multiplier > 0:
        out["sample_differential_privacy"] = {
            "level": "clip, on every client (DP-SGD through Opacus)",
            "noise_multiplier": plan.dp_sgd_noise_multiplier,
            "clipping_norm": plan.dp_sgd_clipping_norm,
            "delta": plan.dp_delta,
            "epsilon": sample_epsilon(plan, rounds),
            "accountant": "RDP (Opacus), Poisson-sampled batches, computed by the server from the shares it assigned; "
            "the largest client's, as if it took every round",
        }
    return out


class _Client:
    """A SuperNode's trainer: its own clips, the global weights in, its own weights and example count out."""

    def __init__(self, node_config: dict[str, Any]) -> None:
        self.store = ClipStore.open(Path(str(node_config["store"])))
        self.index = int(node_config.get("partition-id", 0))
        parts = int(node_config.get("num-partitions", 1))
        how: Literal["iid", "by_class"] = str(node_config.get("partition", "iid"))  # type: ignore[assignment]
        self.dataset = ClipDataset(self.store, str(node_config.get("split", "train")))
        self.share = partition(self.dataset.labels, parts, how, int(node_config.get("seed", 0)))[self.index]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        shape = int(config["classes"]), int(config["frames"]), int(config["size"])
        arch = architecture(str(config["model"]), *shape, **json.loads(str(config["overrides"])))
        model = arch.build(seed=int(config["seed"]))
        model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(model.state_dict(), parameters)})
        crop = int(config["crop"]) or None
        augment = Augment(crop, bool(config["flip"]), int(config["seed"]) * 1009 + self.index)
        sample_dp = None
        if float(config.get("dp_sgd_noise", 0.0)) > 0:
            sample_dp = dpsgd.SampleDP(
                float(config["dp_sgd_noise"]), float(config["dp_sgd_clip"]), float(config["dp_delta"])
            )
        metrics = train_locally(
            model,
            self.dataset,
            self.share,
            int(config["epochs"]),
            float(config["lr"]),
            int(config["batch"]),
            int(config["round"]),
            augment,
            float(config.get("proximal_mu", 0.0)),
            sample_dp,
        )
        weights = [v.detach().numpy() for v in model.state_dict().values()]
        transport = str(config.get("transport", "fp32"))
        if transport == "fp32":
            return weights, len(self.share), metrics
        sent = [encode(w, g, transport) for w, g in zip(weights, parameters)]
        return sent, len(self.share), {**metrics, "transport": transport}


def client(context):
    """The ClientApp's client_fn: this SuperNode's trainer, from its node config (its store and share)."""
    from flwr.client import NumPyClient

    trainer = _Client(dict(context.node_config))

    class Client(NumPyClient):
        def fit(self, parameters, config):
            return trainer.fit(parameters, config)

    return Client().to_client()


def train_locally(
    model: torch.nn.Module,
    dataset: ClipDataset,
    share: np.ndarray,
    epochs: int,
    lr: float,
    batch: int,
    round_index: int,
    augment: Augment,
    proximal_mu: float = 0.0,
    sample_dp: dpsgd.SampleDP | None = None,
) -> dict[str, float]:
    """``epochs`` passes over ``share`` with a fresh AdamW (FedAvg clients keep no state between rounds).

    With ``sample_dp``, AdamW steps are DP-SGD's (:mod:`dpsgd`): each on a Poisson sample of the share, and the
    sample-level epsilon the client has spent after this round (``round_index``, from 1) comes back.

    With ``proximal_mu`` (FedProx) each client minimises its loss + mu/2 x |w - w_global|^2, w_global the weights the
    round began with. The proximal term's gradient is applied the way AdamW applies weight decay, decoupled from the
    adaptive step: after each AdamW step, w moves lr x mu of the way back to w_global (the step plain gradient
    descent takes on that term). Added to the loss instead, AdamW divides it by each weight's gradient history like
    the loss's own gradient, so a small pull sets the direction of every weight whose loss gradient is small, and
    FedProx fell below FedAvg on non-IID clients at every mu tried (README, "Federated training").
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    rng = np.random.default_rng([augment.seed, round_index])
    private = None
    if sample_dp:
        private = dpsgd.PrivateSteps(model, optimizer, len(share), batch, sample_dp)
        optimizer = private.optimizer
    net = private.module if private else model
    if private:  # a Poisson sample can be empty: a batch of no clips, of the augmented clips' shape
        empty = augment(dataset[int(share[0])][0][None], 0)[:0]
    model.train()
    for epoch in range(epochs):
        if private:
            batches = (share[drawn] for drawn in private.batches())
        else:
            order = share[rng.permutation(len(share))]
            batches = (order[start : start + batch] for start in range(0, len(order), batch))
        for k, chosen in enumerate(batches):
            items = [dataset[int(i)] for i in chosen]
            labels = torch.tensor([y for _, y in items], dtype=torch.int64)
            optimizer.zero_grad()
            step = (round_index * epochs + epoch) * len(share) + k * batch
            logits = net(augment(torch.stack([c for c, _ in items]), step) if items else empty)
            (F.cross_entropy(logits, labels) if items else logits.sum()).backward()
            optimizer.step()
            if anchor:
                with torch.no_grad():
                    for p, a in zip(model.parameters(), anchor):
                        p.lerp_(a, lr * proximal_mu)  # at most 1: fl_train's check refuses more
    if not private:
        return {}
    private.close()
    steps = round_index * epochs * private.steps_per_epoch
    return {"sample_epsilon": dpsgd.epsilon(sample_dp.noise_multiplier, private.sample_rate, steps, sample_dp.delta)}
