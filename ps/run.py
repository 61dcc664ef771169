"""A parameter-server job: roles from the ranks, RPC set-up and the end of the run.

Ranks ``0..S-1`` serve, ranks ``S..S+W-1`` train. The ranks trust each other:
this is cluster-internal training. Federated training, with clients that do not
trust the server or each other, is ``jobs/fl_train.py`` on Flower.
Names and the rendezvous address come from the ``hpc`` distributed contract.
Server 0 closes the run: once every trainer has finished or been dropped, it
gathers the shards, writes the same run directory a DeepSpeed run leaves
(through :class:`clipforge.rundir.RunDir`: final weights, the run record, the
evaluation, metrics, plots), then stops the other servers. Nobody waits on a dead trainer: the
shutdown is not the collective ``rpc.shutdown(graceful=True)``, which would.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed import rpc

from clipforge.base.errors import UserError
from clipforge.hpc.distenv import DistEnv
from clipforge.inference.evaluation import evaluate_model
from clipforge.models.builders import Architecture, start_from
from clipforge.preprocess.reader import ClipDataset
from clipforge.preprocess.store import ClipStore
from clipforge.rundir import RunDir, RunRecord
from clipforge.train.inputs import DataSettings, ModelSettings, resolve_inputs

from . import server as srv
from . import worker

log = logging.getLogger(__name__)


class PSError(UserError):
    """A parameter-server job that cannot start as configured."""


@dataclasses.dataclass
class PSSettings:
    run_dir: Path = Path("runs/ps")
    """Run directory (config, metrics, server checkpoints, final weights)."""
    servers: int = 1
    """Server ranks (the first ones)."""
    seed: int = 0
    """Seed of initialisation, partitions, sampling and augmentation."""
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    server: srv.ServerSettings = dataclasses.field(default_factory=srv.ServerSettings)
    trainer: worker.TrainerSettings = dataclasses.field(default_factory=worker.TrainerSettings)


def check(s: PSSettings, world_size: int) -> tuple[ClipStore, Architecture]:
    """Refuse what cannot work before any process starts."""
    if s.servers < 1 or world_size - s.servers < 1:
        raise PSError(
            f"{world_size} tasks cannot hold {s.servers} server(s) and at least one trainer; ask for more tasks or "
            "fewer servers"
        )
    unread = s.data.set_but_unread(worker.DATA_READ)
    if unread:
        raise PSError(
            f"{unread}: a parameter-server trainer reads its own share in its own process, in its own seeded order, "
            "with plain cross-entropy, so it would have no effect; leave it out"
        )
    if s.model.registry_reference() is not None:
        raise PSError(
            f"--model.weights {s.model.weights}: the parameter-server job does not fetch registry versions; fetch it "
            "with clipforge registry pull NAME@REF --to DIR and give DIR/model.safetensors"
        )
    inputs = resolve_inputs(s.model, s.data, try_weights=True)  # a run or an imported model brings its architecture
    return inputs.store, inputs.arch


def _record(
    s: PSSettings, store: ClipStore, metrics: dict[str, Any], steps: int, env: DistEnv, **extra: Any
) -> RunRecord:
    record = RunRecord.of_run(s.model.name, s.model.overrides(), store, s.data.crop, metrics, steps, env)
    return dataclasses.replace(record, **extra)


def run(s: PSSettings, env: DistEnv) -> dict[str, Any] | None:
    """This process's part of the job, by rank."""
    store, arch = check(s, env.world_size)
    run_dir = RunDir(s.run_dir).prepare()
    trainers = [f"trainer{t}" for t in range(env.world_size - s.servers)]
    servers = [f"server{k}" for k in range(s.servers)]
    is_server = env.rank < s.servers
    name = servers[env.rank] if is_server else trainers[env.rank - s.servers]
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{env.master_addr}:{env.master_port}", rpc_timeout=600)
    torch.manual_seed(s.seed)
    model = arch.build(seed=s.seed)
    if s.model.weights is not None:
        start_from(model, Path(s.model.weights))
    owner = srv.assign_shards({k: tuple(v.shape) for k, v in model.state_dict().items()}, s.servers)
    dataset = ClipDataset(store, s.data.train_split)
    shares = worker.partition(dataset.labels, len(trainers), s.trainer.partition, s.seed)
    if is_server:
        mine = {k: v for k, v in model.state_dict().items() if owner[k] == env.rank}
        server = srv.ShardServer(env.rank, mine, trainers, s.server, run_dir.server_checkpoint(env.rank))
        srv.install(server)
        rpc.init_rpc(name, rank=env.rank, world_size=env.world_size, rpc_backend_options=options)
        started = time.time()
        server.finished.wait()
        server.save_now()
        result = _close(s, env, run_dir, servers, store, model, started) if env.rank == 0 else None
        if env.rank != 0:
            server.stopped.wait()
            time.sleep(1.0)  # let server 0's last calls be answered before this process goes away
        rpc.shutdown(graceful=False)
        return result
    rpc.init_rpc(name, rank=env.rank, world_size=env.world_size, rpc_backend_options=options)
    t = env.rank - s.servers
    probe = ClipDataset(store, s.data.eval_split) if t == 0 and s.trainer.probe_every else None
    reporter = run_dir if t == 0 else None
    augment = worker.Augment(s.data.crop, s.data.flip, s.seed)
    worker.Worker(t, servers, owner, model, dataset, shares[t], s.trainer, s.seed, augment, reporter, probe).run()
    rpc.shutdown(graceful=False)
    return None


def _close(
    s: PSSettings,
    env: DistEnv,
    run_dir: RunDir,
    servers: list[str],
    store: ClipStore,
    model: torch.nn.Module,
    started: float,
) -> dict[str, Any]:
    """Server 0: assemble the model from every shard, evaluate, write the run directory, stop the other servers."""
    states = [srv.remote_state()] + [rpc.rpc_sync(name, srv.remote_state) for name in servers[1:]]
    state: dict[str, torch.Tensor] = {}
    for shard in states:
        overlap = set(state) & set(shard["params"])
        assert not overlap, f"parameters on two servers: {sorted(overlap)[:3]}"
        state.update(shard["params"])
    for name in servers[1:]:
        rpc.rpc_sync(name, srv.remote_stop)
    model.load_state_dict(state)
    metrics = evaluate_model(model, ClipDataset(store, s.data.eval_split), s.trainer.batch_per_rank, s.data.crop)
    updates = sum(shard["version"] for shard in states) / len(states)
    staleness = [x for shard in states for x in shard["staleness"]]
    gaps = [x for shard in states for x in shard["clock_gaps"]]
    summary = {
        "kind": "ps",
        "mode": s.server.mode,
        "updates": updates,
        "updates_per_s": updates / max(time.time() - started, 1e-9),
        "staleness_histogram": np.bincount(np.asarray(staleness, dtype=np.int64)).tolist() if staleness else [],
        "max_clock_gap": max(gaps) if gaps else 0,
        "shard_sizes": [sum(v.numel() for v in sh["params"].values()) for sh in states],
        "clocks": states[0]["clocks"],
    }
    run_dir.append_metrics(summary)
    run_dir.append_metrics({"kind": "eval", "step": int(updates), **metrics})
    figures = {k: v for k, v in summary.items() if k != "kind"}
    record = _record(s, store, metrics, int(updates), env, parameter_server=figures)
    weights = run_dir.write_final(state, record, metrics)
    log.info(
        "%s: %d updates (%.1f/s); %s video top-1 %.3f; weights in %s",
        summary["mode"],
        updates,
        summary["updates_per_s"],
        metrics["split"],
        metrics["video_top1"],
        weights,
    )
    return {"metrics": metrics, "summary": summary, "weights": str(weights)}
