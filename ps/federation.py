"""A federation as a job runs it: its settings, the checks made before anything starts, the server's plan, and
each task's part (the SuperLink and its gate, the job's SuperNodes, the clients of a task each).

``jobs/fl_train.py`` is the job: it adds the launch and resources, and where the starting weights come from.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from clipforge.base.errors import UserError
from clipforge.hpc.distenv import DistEnv, free_port
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.rundir import RunDir
from clipforge.train.inputs import DataSettings, ModelSettings, resolve_inputs

from . import certs, dpsgd, guard, privacy
from .federated import HEARTBEAT, FederatedPlan
from .flower import FlowerError, SuperLink, SuperNode, note, wait_note
from .gate import stop_all
from .worker import DATA_READ, partition

log = logging.getLogger("clipforge.fl_train")


class FederationError(UserError):
    """A federation that cannot work as configured; the message says what to change."""


@dataclasses.dataclass
class FederationSettings:
    """Federated training of a video classifier on Flower, with TLS and authenticated clients."""

    run_dir: Path = Path("runs/fl")
    """Where config, metrics per round, the global model of each round and the final weights go."""
    clients: int = 2
    """Clients in the federation: a key registered for each, a SuperNode for each but --outside's."""
    outside: int = 0
    """The last N clients are sites elsewhere, which join with `clipforge fl join`."""
    client_examples: tuple[float, ...] | None = None
    """The examples each client's update weighs by (default: its share of the store; claims are ignored)."""
    aggregation: guard.Aggregation = "fedavg"
    """How the server combines the checked updates: fedavg, or for hostile clients trimmed-mean, median or krum."""
    rounds: int = 5
    """Federated rounds."""
    min_clients: int | None = None
    """Clients a round waits for and samples at least; default: all of --clients."""
    client_fraction: float = 1.0
    """Share of the available clients sampled each round."""
    local_epochs: int = 1
    """Passes each client makes over its own clips per round."""
    lr: float = 0.002
    """Clients' AdamW learning rate (a fresh optimizer each round)."""
    batch_per_rank: int = 8
    """Clips per local step of each client."""
    shares: Literal["iid", "by_class"] = "iid"
    """How the store's training clips are divided among the clients: at random, or by class (non-IID)."""
    secagg: bool = False
    """Sum the clients' updates under Flower's SecAgg+: the server learns only their sum."""
    secagg_quantization_range: int = 2**22
    """SecAgg+: levels each weight is quantised into over [-clipping range, clipping range]."""
    secagg_clipping_range: float = 8.0
    """SecAgg+: every weight is clipped to [-range, range] before quantisation."""
    secagg_may_drop: float = 0.0
    """SecAgg+: the share of a client's neighbours (up to 2 log2 n + 1 of the round's clients) that may drop after
    masking without stopping the round."""
    transport: Literal["fp32", "bf16", "fp16"] = "fp32"
    """How clients send their updates: fp32 weights, or their change from the global model in bf16 or fp16 (half
    the bytes up; not with --secagg, which quantises on its own, or --dp.*, whose clipping needs the weights)."""
    proximal_mu: float = 0.0
    """FedProx: each client's loss gains mu/2 x |w - w_global|^2, which keeps non-IID clients near the global model
    (0: plain FedAvg). Applied decoupled from AdamW, as its weight decay is: each step moves lr x mu of the way back
    to the global model, so mu is on plain gradient descent's scale (10 at lr 0.001: 1% a step)."""
    certs: Path | None = None
    """The federation's keys (clipforge fl certs); default: <run-dir>/certs, made when missing."""
    port: int = 0
    """The SuperLink's port (0: a free one)."""
    eval_every: int = 1
    """Rounds between the server's evaluations of the global model on the eval split (always after the last
    round): the clients wait while it evaluates, so a large eval split wants a larger interval."""
    round_timeout_s: float = 600.0
    """How long a round waits for its clients' answers (under --secagg: each of its four exchanges): a client that
    has not answered by then (a lost node) is left out, and the round goes on if --min-clients answered."""
    seed: int = 0
    """Seed of the model's initialisation, the partition and the clients' shuffling."""
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    dp: privacy.DPSettings = dataclasses.field(default_factory=privacy.DPSettings)

    @property
    def keys(self) -> Path:
        return self.certs if self.certs is not None else self.run_dir / "certs"


def check(cfg: FederationSettings, ntasks: int, gpus_per_node: int = 0) -> None:
    """Refuse a federation that cannot work before anything starts (``ntasks``: the job's tasks)."""
    if cfg.clients < 1 or cfg.rounds < 1 or cfg.local_epochs < 1 or cfg.batch_per_rank < 1:
        raise FederationError("clients, rounds, local_epochs and batch_per_rank must be at least 1")
    wanted = cfg.min_clients if cfg.min_clients is not None else cfg.clients
    if not 1 <= wanted <= cfg.clients:
        raise FederationError(f"--min-clients {wanted}: give 1 to --clients ({cfg.clients})")
    if not 0 <= cfg.outside <= cfg.clients:
        raise FederationError(f"--outside {cfg.outside}: give 0 to --clients ({cfg.clients})")
    local = cfg.clients - cfg.outside
    if ntasks not in (1, local + 1):
        raise FederationError(
            f"{ntasks} tasks for {local} clients: give one task for the whole federation, or one "
            f"for the server and one per client (e.g. --nodes {local + 1} --ntasks-per-node 1)"
        )
    if cfg.client_examples is not None and (len(cfg.client_examples) != cfg.clients or min(cfg.client_examples) <= 0):
        raise FederationError(
            f"--client-examples {' '.join(f'{n:g}' for n in cfg.client_examples)}: give one positive count per "
            f"client ({cfg.clients})"
        )
    if cfg.aggregation != "fedavg" and (cfg.secagg or cfg.dp.noise_multiplier > 0 or cfg.dp.target_epsilon):
        raise FederationError(
            f"--aggregation {cfg.aggregation} needs each update in the clear and a mean's noise: SecAgg+ shows the "
            "server only the sum, and client-level DP's noise is calibrated to a mean; drop one of them"
        )
    if cfg.transport != "fp32" and (cfg.secagg or cfg.dp.noise_multiplier > 0 or cfg.dp.target_epsilon is not None):
        raise FederationError(
            f"--transport {cfg.transport} goes with plain FedAvg or FedProx only: SecAgg+ quantises the updates itself "
            "and DP clips the full weights; drop --transport or --secagg/--dp.*"
        )
    if cfg.dp.problem():
        raise FederationError(cfg.dp.problem())
    if cfg.proximal_mu < 0:
        raise FederationError(f"--proximal-mu {cfg.proximal_mu}: give 0 (FedAvg) or more (FedProx)")
    if cfg.lr * cfg.proximal_mu > 1:
        raise FederationError(
            f"--proximal-mu {cfg.proximal_mu:g} with --lr {cfg.lr:g}: each step moves lr x mu of the way back to the "
            f"global model, which must be at most 1; give --proximal-mu {1 / cfg.lr:g} or less"
        )
    if cfg.dp.target_epsilon is not None and budgeted_rounds(cfg) == 0:
        first = privacy.epsilon(noise_multiplier(cfg), cfg.client_fraction, 1, cfg.dp.delta)
        raise FederationError(
            f"--dp.target-epsilon {cfg.dp.target_epsilon}: one round already spends epsilon {first:.3g}; raise "
            "the budget or --dp.noise-multiplier"
        )
    if not 0 <= cfg.secagg_may_drop < 1:
        raise FederationError(f"--secagg-may-drop {cfg.secagg_may_drop}: give a share in [0, 1)")
    if cfg.eval_every < 1:
        raise FederationError(f"--eval-every {cfg.eval_every}: give a number of rounds, 1 or more")
    if not 0 < cfg.client_fraction <= 1:
        raise FederationError(f"--client-fraction {cfg.client_fraction}: give a share in (0, 1]")
    unread = cfg.data.set_but_unread(DATA_READ)
    if unread:
        raise FederationError(
            f"{unread}: federated clients train on their own share in a seeded order with plain cross-entropy, "
            "so it would have no effect; leave it out"
        )
    if gpus_per_node:
        raise FederationError(
            f"--gpus-per-node {gpus_per_node}: federated training runs its server and clients on CPUs; leave it out"
        )
    inputs = resolve_inputs(cfg.model, cfg.data, try_weights=True)
    if len(inputs.train_set) < cfg.clients:
        raise FederationError(
            f"split {cfg.data.train_split!r} has {len(inputs.train_set)} clips for {cfg.clients} clients"
        )
    if cfg.dp.sample_noise_multiplier > 0 and (why := dpsgd.problem(inputs.arch.build(seed=0))):
        raise FederationError(
            f"--dp.sample-noise-multiplier with --model.name {cfg.model.name}: Opacus cannot train it with DP-SGD "
            f"({why}); choose a videovit model"
        )
    if cfg.certs is not None and not (cfg.certs / certs.CA_CERT).exists():
        raise FederationError(f"--certs {cfg.certs}: no {certs.CA_CERT} there; make the keys with clipforge fl certs")


def noise_multiplier(cfg: FederationSettings) -> float:
    """The DP noise: --dp.noise-multiplier, or the least that spends --dp.target-epsilon over --rounds."""
    return cfg.dp.noise_for(cfg.client_fraction, cfg.rounds)


def budgeted_rounds(cfg: FederationSettings) -> int:
    """The rounds the privacy budget allows (all of them without a budget)."""
    if cfg.dp.target_epsilon is None:
        return cfg.rounds
    return privacy.rounds_within(
        cfg.dp.target_epsilon, noise_multiplier(cfg), cfg.client_fraction, cfg.rounds, cfg.dp.delta
    )


def examples(cfg: FederationSettings) -> list[float]:
    """What each client's update weighs by: --client-examples, or its share of the store's training clips."""
    if cfg.client_examples is not None:
        return [float(n) for n in cfg.client_examples]
    labels = ClipDataset(ClipStore.open(cfg.data.store), cfg.data.train_split).labels
    return [float(len(share)) for share in partition(labels, cfg.clients, cfg.shares, cfg.seed)]


def plan(cfg: FederationSettings, start: Path | None = None, nodes: dict[str, int] | None = None) -> FederatedPlan:
    """The server's plan; ``start``: the weights file the global model starts from (:func:`starting_weights`);
    ``nodes``: the node ids the job registered, and which client each is."""
    shares = examples(cfg)
    return FederatedPlan(
        run_dir=str(cfg.run_dir.resolve()),
        store=str(Path(cfg.data.store).resolve()),
        model=cfg.model.name,
        overrides=cfg.model.overrides(),
        rounds=budgeted_rounds(cfg),
        min_clients=cfg.min_clients if cfg.min_clients is not None else cfg.clients,
        clients=cfg.clients,
        client_fraction=cfg.client_fraction,
        local_epochs=cfg.local_epochs,
        lr=cfg.lr,
        batch=cfg.batch_per_rank,
        eval_split=cfg.data.eval_split,
        eval_every=cfg.eval_every,
        crop=cfg.data.crop,
        flip=cfg.data.flip,
        seed=cfg.seed,
        secagg=cfg.secagg,
        dp_noise_multiplier=noise_multiplier(cfg),
        dp_clipping_norm=cfg.dp.clipping_norm,
        dp_delta=cfg.dp.delta,
        dp_sgd_noise_multiplier=cfg.dp.sample_noise_multiplier,
        dp_sgd_clipping_norm=cfg.dp.sample_clipping_norm,
        proximal_mu=cfg.proximal_mu,
        round_timeout_s=cfg.round_timeout_s,
        transport=cfg.transport,
        secagg_clipping_range=cfg.secagg_clipping_range,
        secagg_quantization_range=cfg.secagg_quantization_range,
        secagg_may_drop=cfg.secagg_may_drop,
        # SecAgg+ scales each update by its count over this before quantising: the largest assigned share.
        secagg_max_weight=max(shares),
        start_weights=None if start is None else str(start.resolve()),
        start_source=None if cfg.model.weights is None else str(cfg.model.weights),
        nodes=dict(nodes or {}),
        examples=shares,
        aggregation=cfg.aggregation,
    )


def node_config(cfg: FederationSettings, index: int) -> dict[str, object]:
    """What SuperNode ``index`` is told of its data (a client elsewhere has its own store)."""
    return {
        "store": str(Path(cfg.data.store).resolve()),
        "split": cfg.data.train_split,
        "partition-id": index,
        "num-partitions": cfg.clients,
        "partition": cfg.shares,
        "seed": cfg.seed,
    }


def serve(cfg: FederationSettings, env: DistEnv, start_from: Callable[[RunDir], Path | None]) -> dict | None:
    """This task's part of the federation: with one task, the server and every local client; with several, task
    0 serves and every other task is one client (:func:`client_task`). ``start_from(run)``: the weights file the
    global model starts from, made ready in the run directory (None: the seed's initialisation)."""
    local = cfg.clients - cfg.outside
    if env.world_size not in (1, local + 1):
        raise FlowerError(
            f"{env.world_size} tasks for {local} clients: give one task for the whole federation, or one for "
            f"the server and one per client ({local + 1})"
        )
    if env.world_size > 1 and env.rank > 0:
        return client_task(cfg, env.rank - 1, env.job_id, env.restart_count)
    run = RunDir(cfg.run_dir).prepare()
    work = run.root / "flower"
    start = start_from(run)
    announce_budget(cfg)
    started = time.monotonic()
    if env.world_size == 1:  # the server and every client in this task
        if cfg.outside:  # sites elsewhere reach the gate at this host's name
            certs.ensure(cfg.keys, cfg.clients, socket.gethostname())
            superlink = SuperLink(cfg.keys, cfg.port or free_port(), work, listen="0.0.0.0")
        else:
            if not (cfg.keys / certs.CA_CERT).exists() or not certs.client_cert(cfg.keys, cfg.clients - 1).exists():
                certs.make_certs(cfg.keys, cfg.clients)
            superlink = SuperLink(cfg.keys, cfg.port or free_port(), work)
        address = superlink.fleet_address
    else:  # this task serves; the other tasks, on whichever nodes Slurm gave them, are the clients
        certs.ensure(cfg.keys, cfg.clients, env.master_addr)
        superlink = SuperLink(cfg.keys, cfg.port or env.master_port, work, listen="0.0.0.0")
        address = f"{env.master_addr}:{cfg.port or env.master_port}"
    nodes: list[SuperNode] = []
    status, run_id = "not started", None
    try:
        registered = {str(superlink.register(certs.client_public_key(cfg.keys, i))): i for i in range(cfg.clients)}
        if env.world_size == 1:
            for i in range(local):
                key = certs.client_key(cfg.keys, i)
                nodes.append(
                    SuperNode(
                        i,
                        key,
                        certs.client_cert(cfg.keys, i),
                        cfg.keys / certs.CA_CERT,
                        address,
                        node_config(cfg, i),
                        None,
                        work,
                    )
                )
            for node in nodes:
                node.wait_ready()
            log.info("gate at %s (mutual TLS) with %d authenticated SuperNodes of this job", address, len(nodes))
        else:
            note(work, "superlink", env.job_id, env.restart_count, address)
            log.info("gate at %s (mutual TLS); %d client tasks join it", address, local)
        if cfg.outside:
            there = address if env.world_size > 1 else f"{socket.gethostname()}:{address.rsplit(':', 1)[1]}"
            log.info(
                "waiting for %d clients from other sites: `clipforge fl join --superlink %s ...`", cfg.outside, there
            )
        plan_file = plan(cfg, start, registered).write(work / "plan.json")
        # The clients clip their updates only under SecAgg+, where the server cannot: otherwise the server does.
        run_config = {"plan": str(plan_file), "secagg": cfg.secagg, "dp": cfg.secagg and noise_multiplier(cfg) > 0}
        # The ServerApp beats every 10 s once started; its start (imports, the store, the model) takes the allowance.
        run_id, status = superlink.run(run_config, 600, run.root / HEARTBEAT)
    finally:
        if env.world_size > 1:
            note(work, "finished", env.job_id, env.restart_count, status)
        stop_all([*nodes, superlink])
    if status != "finished:completed":
        raise FlowerError(f"federated run {run_id} ended {status}; its log: {work / 'logs' / f'run-{run_id}.log'}")
    record = run.record()
    log.info(
        "federation of %d clients finished %d rounds in %.0f s: video top-1 %.3f; weights in %s",
        cfg.clients,
        record.steps,
        time.monotonic() - started,
        record.metrics["video_top1"],
        run.weights,
    )
    return {"rounds": record.steps, "metrics": record.metrics, "weights": str(run.weights)}


def announce_budget(cfg: FederationSettings) -> None:
    """Say what the privacy budget does to this federation: the noise it set, or the rounds it cuts."""
    within = budgeted_rounds(cfg)
    if cfg.dp.target_epsilon is not None and cfg.dp.noise_multiplier == 0:
        log.info(
            "differential privacy: noise multiplier %.4g spends epsilon %g (delta %g) over %d rounds",
            noise_multiplier(cfg),
            cfg.dp.target_epsilon,
            cfg.dp.delta,
            cfg.rounds,
        )
    if within < cfg.rounds:
        spent = privacy.epsilon(noise_multiplier(cfg), cfg.client_fraction, within, cfg.dp.delta)
        log.warning(
            "the privacy budget (epsilon %g at delta %g) allows %d of the %d rounds: the federation stops after "
            "round %d, at epsilon %.3g",
            cfg.dp.target_epsilon,
            cfg.dp.delta,
            within,
            cfg.rounds,
            within,
            spent,
        )


def client_task(cfg: FederationSettings, index: int, job: str | None, restarts: int) -> None:
    """A Slurm task that is client ``index``: one SuperNode that joins the job's SuperLink and trains until it ends."""
    work = Path(cfg.run_dir) / "flower"
    address = wait_note(work, "superlink", job, restarts, timeout_s=600)
    if address is None:
        raise FlowerError(f"client {index}: the server task did not start its SuperLink within 600 s; see its log")
    key, cert = certs.client_key(cfg.keys, index), certs.client_cert(cfg.keys, index)
    node = SuperNode(index, key, cert, cfg.keys / certs.CA_CERT, address, node_config(cfg, index), None, work)
    finished = None
    try:
        node.wait_ready()
        log.info("client %d: SuperNode joined %s", index, address)
        while finished is None and node.process.poll() is None:
            finished = wait_note(work, "finished", job, restarts, timeout_s=2.0)
    finally:
        node.stop()
    if finished is None:
        raise FlowerError(f"client {index}: its SuperNode ended before the federation did; see {node.log}")
    log.info("client %d: the federation ended (%s)", index, finished)
    return None
