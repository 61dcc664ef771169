"""A parameter-server job: roles from the ranks, RPC set-up, the end of the run, and federated averaging.

Ranks ``0..S-1`` serve, ranks ``S..S+W-1`` train (or are federated clients).
Names and the rendezvous address come from the ``hpc`` distributed contract.
Server 0 closes the run: once every trainer has finished or been dropped, it
gathers the shards, writes the same run directory a DeepSpeed run leaves
(``final/model.safetensors``, ``final/run.json``, ``eval.json``, metrics,
plots), then stops the other servers. Nobody waits on a dead trainer: the
shutdown is not the collective ``rpc.shutdown(graceful=True)``, which would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed import rpc

from clipforge.hpc.distenv import DistEnv
from clipforge.models.builders import architecture
from clipforge.models.trainer import evaluate_model, run_record, write_final
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore

from . import server as srv
from . import worker

log = logging.getLogger(__name__)


class PSError(ValueError):
    """A parameter-server job that cannot start as configured."""


@dataclasses.dataclass
class PSSettings:
    run_dir: Path = Path("runs/ps")
    """Run directory (config, metrics, server checkpoints, final weights)."""
    store: Path = Path("store")
    """Clip store."""
    train_split: str = "train"
    """Split to train on."""
    eval_split: str = "val"
    """Split to evaluate on at the end."""
    model: str = "videovit-tiny"
    """Model builder name."""
    depth: int | None = None
    """Transformer depth override (videovit-* only)."""
    tubelet: tuple[int, int, int] | None = None
    """Tubelet override (videovit-* only)."""
    servers: int = 1
    """Server ranks (the first ones)."""
    algorithm: Literal["ps", "fedavg"] = "ps"
    """ps: parameter server with async/ssp/sync updates; fedavg: federated averaging rounds."""
    seed: int = 0
    """Seed of initialisation, partitions and sampling."""
    server: srv.ServerSettings = dataclasses.field(default_factory=srv.ServerSettings)
    trainer: worker.TrainerSettings = dataclasses.field(default_factory=worker.TrainerSettings)
    fed: worker.FedSettings = dataclasses.field(default_factory=worker.FedSettings)

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in (("depth", self.depth), ("tubelet", self.tubelet)) if v is not None}


def check(s: PSSettings, world_size: int) -> tuple[ClipStore, Any]:
    """Refuse what cannot work before any process starts."""
    if s.servers < 1 or world_size - s.servers < 1:
        raise PSError(f"{world_size} tasks cannot hold {s.servers} server(s) and at least one trainer; ask for more tasks or fewer servers")
    if s.algorithm == "fedavg" and s.servers != 1:
        raise PSError("federated averaging runs with one server; pass --servers 1")
    store = ClipStore.open(s.store)
    p = store.params
    arch = architecture(s.model, len(store.classes), p["clip_frames"], p["height"], **s.overrides())
    problem = arch.input.problem(p["clip_frames"], p["height"], p["width"])
    if problem:
        raise PSError(f"model {s.model} {problem}")
    return store, arch


def run(s: PSSettings, env: DistEnv) -> dict[str, Any] | None:
    """This process's part of the job, by rank."""
    store, arch = check(s, env.world_size)
    trainers = [f"trainer{t}" for t in range(env.world_size - s.servers)]
    servers = [f"server{k}" for k in range(s.servers)]
    is_server = env.rank < s.servers
    name = servers[env.rank] if is_server else trainers[env.rank - s.servers]
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{env.master_addr}:{env.master_port}", rpc_timeout=600)
    torch.manual_seed(s.seed)
    model = arch.build(seed=s.seed)
    owner = srv.assign_shards({k: tuple(v.shape) for k, v in model.state_dict().items()}, s.servers)
    dataset = ClipDataset(store, s.train_split)
    shares = worker.partition(dataset.labels, len(trainers), s.trainer.partition, s.seed)
    (s.run_dir / "ps").mkdir(parents=True, exist_ok=True)
    if s.algorithm == "fedavg":
        return _fedavg(s, env, name, servers, trainers, model, dataset, shares, store, options)
    if is_server:
        mine = {k: v for k, v in model.state_dict().items() if owner[k] == env.rank}
        server = srv.ShardServer(env.rank, mine, trainers, s.server, s.run_dir / "ps" / f"server-{env.rank}.pt")
        srv.install(server)
        rpc.init_rpc(name, rank=env.rank, world_size=env.world_size, rpc_backend_options=options)
        started = time.time()
        server.finished.wait()
        server.save_now()
        result = _close(s, env, servers, store, started) if env.rank == 0 else None
        if env.rank != 0:
            server.stopped.wait()
            time.sleep(1.0)  # let server 0's last calls be answered before this process goes away
        rpc.shutdown(graceful=False)
        return result
    rpc.init_rpc(name, rank=env.rank, world_size=env.world_size, rpc_backend_options=options)
    t = env.rank - s.servers
    metrics = s.run_dir / "metrics.jsonl" if t == 0 else None
    probe = ClipDataset(store, s.eval_split) if t == 0 and s.trainer.probe_every else None
    trainer = worker.Trainer(t, servers, owner, model, dataset, shares[t], s.trainer, s.seed, metrics, probe)
    trainer.run()
    rpc.shutdown(graceful=False)
    return None


def _close(s: PSSettings, env: DistEnv, servers: list[str], store: ClipStore, started: float) -> dict[str, Any]:
    """Server 0: assemble the model from every shard, evaluate, write the run directory, stop the other servers."""
    states = [srv.remote_state()] + [rpc.rpc_sync(name, srv.remote_state) for name in servers[1:]]
    state: dict[str, torch.Tensor] = {}
    for shard in states:
        overlap = set(state) & set(shard["params"])
        assert not overlap, f"parameters on two servers: {sorted(overlap)[:3]}"
        state.update(shard["params"])
    for name in servers[1:]:
        rpc.rpc_sync(name, srv.remote_stop)
    p = store.params
    model = architecture(s.model, len(store.classes), p["clip_frames"], p["height"], **s.overrides()).build(seed=s.seed)
    model.load_state_dict(state)
    metrics = evaluate_model(model, ClipDataset(store, s.eval_split), s.trainer.batch, None)
    updates = sum(shard["version"] for shard in states) / len(states)
    staleness = [x for shard in states for x in shard["staleness"]]
    gaps = [x for shard in states for x in shard["clock_gaps"]]
    summary = {
        "kind": "ps", "mode": s.server.mode if s.algorithm == "ps" else "fedavg", "updates": updates,
        "updates_per_s": updates / max(time.time() - started, 1e-9),
        "staleness_histogram": np.bincount(np.asarray(staleness, dtype=np.int64)).tolist() if staleness else [],
        "max_clock_gap": max(gaps) if gaps else 0, "shard_sizes": [sum(v.numel() for v in sh["params"].values()) for sh in states],
        "clocks": states[0]["clocks"],
    }  # fmt: skip
    _append(s.run_dir / "metrics.jsonl", summary)
    _append(s.run_dir / "metrics.jsonl", {"kind": "eval", "step": int(updates), **metrics})
    record = run_record(s.model, s.overrides(), store, s.store, None, metrics, int(updates), env.world_size)
    record["parameter_server"] = {k: v for k, v in summary.items() if k != "kind"}
    weights = write_final(s.run_dir, state, record, metrics)
    log.info("%s: %d updates (%.1f/s); %s video top-1 %.3f; weights in %s", summary["mode"], updates, summary["updates_per_s"],
             metrics["split"], metrics["video_top1"], weights)  # fmt: skip
    return {"metrics": metrics, "summary": summary, "weights": str(weights)}


def _fedavg(s: PSSettings, env: DistEnv, name: str, servers: list[str], clients: list[str], model: torch.nn.Module,
            dataset: ClipDataset, shares: list[np.ndarray], store: ClipStore, options) -> dict[str, Any] | None:  # fmt: skip
    if env.rank != 0:
        stop = worker.install_client(model, dataset, shares[env.rank - s.servers], s.seed + env.rank)
        rpc.init_rpc(name, rank=env.rank, world_size=env.world_size, rpc_backend_options=options)
        stop.wait()
        time.sleep(1.0)
        rpc.shutdown(graceful=False)
        return None
    rpc.init_rpc(name, rank=0, world_size=env.world_size, rpc_backend_options=options)
    started = time.time()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(s.seed)
    f = s.fed
    eval_set = ClipDataset(store, s.eval_split)
    for r in range(f.rounds):
        k = max(1, int(round(f.client_fraction * len(clients))))
        chosen = sorted(rng.choice(len(clients), size=k, replace=False))
        futures = {c: rpc.rpc_async(clients[c], worker.local_train, args=(state, f.local_epochs, f.lr, f.batch, r), timeout=f.round_timeout_s) for c in chosen}
        results = []
        for c, future in futures.items():
            try:
                results.append(future.wait())
            except RuntimeError as exc:
                log.warning("round %d: client %d left out (%s)", r, c, str(exc).splitlines()[0])
        if not results:
            raise PSError(f"round {r}: no client answered")
        total = sum(n for _, n in results)
        state = {key: sum(w[key].float() * (n / total) for w, n in results).to(state[key].dtype) for key in state}
        model.load_state_dict(state)
        row = {"kind": "train", "step": r + 1, "clients": len(results)}
        if (r + 1) % max(1, f.rounds // 5) == 0 or r + 1 == f.rounds:
            m = evaluate_model(model, eval_set, f.batch, None)
            row.update(loss=m["loss"], video_top1=m["video_top1"])
            log.info("round %d/%d: %d clients, %s video top-1 %.3f", r + 1, f.rounds, len(results), m["split"], m["video_top1"])
        _append(s.run_dir / "metrics.jsonl", row)
    for client in clients:
        try:
            rpc.rpc_sync(client, worker.client_stop, timeout=30)
        except RuntimeError:
            pass  # a client that died has nothing to stop
    metrics = evaluate_model(model, eval_set, f.batch, None)
    _append(s.run_dir / "metrics.jsonl", {"kind": "eval", "step": f.rounds, **metrics})
    record = run_record(s.model, s.overrides(), store, s.store, None, metrics, f.rounds, env.world_size)
    record["federated"] = {"rounds": f.rounds, "clients": len(clients), "local_epochs": f.local_epochs, "client_fraction": f.client_fraction,
                           "partition": s.trainer.partition, "seconds": time.time() - started}  # fmt: skip
    weights = write_final(s.run_dir, state, record, metrics)
    rpc.shutdown(graceful=False)
    return {"metrics": metrics, "weights": str(weights)}


def _append(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=float) + "\n")
