"""Parameter servers: each holds a shard of the model and its optimizer state, and applies gradients as they come.

The functions at the bottom are what trainers call over ``torch.distributed.rpc``;
they run on the server process and act on its one :class:`ShardServer`. A push
is an ``async_execution`` function returning a future, so that a trainer can be
held back (SSP, sync rounds) without holding an RPC thread; a lock guards the
shard, never a model stepped by several trainers at once (the PyTorch example
server hangs or races with more than two trainers, pytorch/examples #780, #842).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from torch.distributed import rpc

from clipforge.base.files import replacing

log = logging.getLogger(__name__)

Mode = Literal["async", "ssp", "sync"]


@dataclasses.dataclass
class ServerSettings:
    mode: Mode = "async"
    """async: apply every gradient at once; ssp: bounded staleness; sync: average all live trainers, then step."""
    staleness: int = 2
    """SSP bound s: a trainer waits when it is more than s clocks ahead of the slowest live trainer."""
    scale_stale: bool = False
    """Scale a stale gradient's step by 1 / (1 + staleness)."""
    optimizer: Literal["sgd", "adamw"] = "sgd"
    """Optimizer on the servers."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay."""
    trainer_timeout_s: float = 30.0
    """A trainer not heard from for this long is dropped from the staleness bound and from sync rounds, until it
    is heard from again."""
    checkpoint_every: int = 100
    """Checkpoint the shard every N applied updates."""


def assign_shards(shapes: dict[str, tuple[int, ...]], servers: int) -> dict[str, int]:
    """Parameter name -> server, balanced by size (largest first onto the least loaded server)."""
    load = [0] * servers
    owner = {}
    for name, shape in sorted(shapes.items(), key=lambda kv: (-_numel(kv[1]), kv[0])):
        k = min(range(servers), key=lambda i: (load[i], i))
        owner[name] = k
        load[k] += _numel(shape)
    return owner


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ShardServer:
    """One server's shard: parameters, optimizer state, trainer clocks, and the update rules."""

    def __init__(
        self,
        index: int,
        params: dict[str, torch.Tensor],
        trainers: list[str],
        settings: ServerSettings,
        checkpoint: Path | None,
    ) -> None:
        self.index, self.settings, self.checkpoint_path = index, settings, checkpoint
        self.params = {k: v.detach().clone().float().requires_grad_(True) for k, v in params.items()}
        tensors = list(self.params.values())
        if settings.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                tensors, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
            )
        else:
            self.optimizer = torch.optim.AdamW(tensors, lr=settings.lr, weight_decay=settings.weight_decay)
        self.lock = threading.Lock()
        self.version = 0
        self.clocks = {t: 0 for t in trainers}
        self.live = set(trainers)
        self.left: set[str] = set()
        """Trainers that finished: the only ones a late word does not bring back."""
        self.last_seen = {t: time.monotonic() for t in trainers}
        self.staleness: list[int] = []
        self.clock_gaps: list[int] = []
        self.waiting: list[tuple[torch.futures.Future, str, int]] = []
        self.round: set[str] = set()
        """The trainers whose gradients this sync round holds, summed in :attr:`round_sum`: one buffer per parameter,
        not one per trainer (16 trainers of a 1 GB shard held 16 GB, and averaging stacked another 16)."""
        self.round_sum: dict[str, torch.Tensor] = {}
        self.round_futures: list[torch.futures.Future] = []
        self.finished = threading.Event()
        """Every trainer has finished or been dropped."""
        self.stopped = threading.Event()
        """Server 0 has collected this shard: the process may go."""
        if checkpoint is not None and checkpoint.exists():
            self._restore(checkpoint)
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    # -- trainer requests --------------------------------------------------------------
    def pull(self, trainer: str) -> tuple[dict[str, torch.Tensor], int]:
        with self.lock:
            self._seen(trainer)
            return {k: v.detach().clone() for k, v in self.params.items()}, self.version

    def push(
        self, trainer: str, grads: dict[str, torch.Tensor], clock: int, pulled_version: int
    ) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self._seen(trainer)
            if self.settings.mode == "sync":
                self.round.add(trainer)
                for name, grad in grads.items():
                    if name in self.round_sum:
                        self.round_sum[name] += grad.float()
                    else:
                        self.round_sum[name] = grad.float().clone()
                self.round_futures.append(done)
                self.clocks[trainer] = clock
                self._maybe_finish_round()
                return done
            stale = self.version - pulled_version
            self.clock_gaps.append(clock - 1 - self._slowest_clock(exclude=None))
            self._apply(grads, scale=1.0 / (1 + stale) if self.settings.scale_stale else 1.0)
            self.staleness.append(stale)
            self.clocks[trainer] = clock
            if self.settings.mode == "ssp" and clock > self._slowest_clock() + self.settings.staleness:
                self.waiting.append((done, trainer, clock))  # held until the slowest catches up
            else:
                done.set_result(self.version)
            self._release_waiting()
        return done

    def leave(self, trainer: str) -> None:
        """A trainer that finished: it no longer holds back the others."""
        with self.lock:
            self.left.add(trainer)
            self._drop(trainer, "finished")

    # -- rules --------------------------------------------------------------------------
    def _apply(self, grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        for name, p in self.params.items():
            p.grad = grads[name].float() * scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.checkpoint_path is not None and self.version % self.settings.checkpoint_every == 0:
            self._save(self.checkpoint_path)

    def _slowest_clock(self, exclude: str | None = None) -> int:
        clocks = [c for t, c in self.clocks.items() if t in self.live and t != exclude]
        return min(clocks) if clocks else 10**9

    def _release_waiting(self) -> None:
        still = []
        slowest = self._slowest_clock()
        for future, trainer, clock in self.waiting:
            if clock <= slowest + self.settings.staleness or trainer not in self.live:
                future.set_result(self.version)
            else:
                still.append((future, trainer, clock))
        self.waiting = still

    def _maybe_finish_round(self) -> None:
        if not self.round or not self.live.issubset(self.round):
            return
        averaged = {n: self.round_sum[n] / len(self.round) for n in self.params}
        self.staleness.extend([0] * len(self.round))
        self._apply(averaged)
        futures, self.round, self.round_sum, self.round_futures = self.round_futures, set(), {}, []
        for f in futures:
            f.set_result(self.version)

    def _seen(self, trainer: str) -> None:
        """A trainer was heard from; one dropped as silent (a long probe, a slow push) is taken back."""
        now = time.monotonic()
        if trainer not in self.live and trainer not in self.left and not self.finished.is_set():
            self.live.add(trainer)
            log.warning(
                "server %d: %s is back after %.0f s; taken back, %d trainer(s) live",
                self.index,
                trainer,
                now - self.last_seen[trainer],
                len(self.live),
            )
        self.last_seen[trainer] = now

    def _drop(self, trainer: str, why: str) -> None:
        if trainer in self.live:
            self.live.discard(trainer)
            log.warning("server %d: %s %s; %d trainer(s) left", self.index, trainer, why, len(self.live))
        self._release_waiting()
        if self.settings.mode == "sync":
            self._maybe_finish_round()
        if not self.live:
            self.finished.set()

    def _watch(self) -> None:
        while not self.finished.is_set():
            time.sleep(min(1.0, self.settings.trainer_timeout_s / 4))
            with self.lock:
                now = time.monotonic()
                # A trainer whose push the server itself is holding (SSP wait, sync round) is waiting, not silent.
                held = {t for _, t, _ in self.waiting} | set(self.round)
                for trainer in held:
                    self.last_seen[trainer] = now
                for trainer in list(self.live):
                    if now - self.last_seen[trainer] > self.settings.trainer_timeout_s:
                        self._drop(trainer, f"silent for {self.settings.trainer_timeout_s:.0f} s (presumed dead)")

    # -- checkpoints ------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "params": {k: v.detach().clone() for k, v in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "clocks": dict(self.clocks),
        }

    def _save(self, path: Path) -> None:
        with replacing(path) as tmp:  # a crash leaves the previous checkpoint
            torch.save(self.state(), tmp)

    def _restore(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for k, v in state["params"].items():
                self.params[k].copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.clocks.update({k: int(v) for k, v in state["clocks"].items() if k in self.clocks})
        log.info("server %d: restored from %s at version %d, clocks %s", self.index, path, self.version, self.clocks)

    def save_now(self) -> None:
        if self.checkpoint_path is not None:
            with self.lock:
                self._save(self.checkpoint_path)


# -- what trainers call, executed on the server process ----------------------------------------
_SERVER: ShardServer | None = None


def install(server: ShardServer) -> None:
    global _SERVER
    _SERVER = server


def current() -> ShardServer:
    assert _SERVER is not None, "no shard server in this process"
    return _SERVER


def remote_pull(trainer: str) -> tuple[dict[str, torch.Tensor], int]:
    return current().pull(trainer)


@rpc.functions.async_execution
def remote_push(trainer: str, grads: dict[str, torch.Tensor], clock: int, pulled_version: int) -> torch.futures.Future:
    return current().push(trainer, grads, clock, pulled_version)


def remote_leave(trainer: str) -> None:
    current().leave(trainer)


def remote_clock(trainer: str) -> int:
    """Where a (restarted) trainer stands: its clock as this server last saw it."""
    return current().clocks.get(trainer, 0)


def remote_state() -> dict:
    server = current()
    with server.lock:
        return {
            "params": {k: v.detach().clone() for k, v in server.params.items()},
            "version": server.version,
            "clocks": dict(server.clocks),
            "staleness": list(server.staleness),
            "clock_gaps": list(server.clock_gaps),
        }


def remote_stop() -> None:
    current().stopped.set()
