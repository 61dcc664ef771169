"""Workers (trainers): the processes that compute on their own data and talk to the servers."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed import rpc

from clipforge.inference.evaluation import evaluate_model
from clipforge.models.clips import random_crop_flip
from clipforge.preprocess.reader import ClipDataset
from clipforge.rundir import RunDir

from . import server as srv

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainerSettings:
    steps: int = 100
    """Iterations (clocks) per trainer."""
    batch_per_rank: int = 8
    """Clips per iteration of each trainer."""
    n_fetch: int = 1
    """Pull fresh parameters every n iterations (Downpour's n_fetch)."""
    n_push: int = 1
    """Push accumulated gradients every n iterations (Downpour's n_push)."""
    partition: Literal["iid", "by_class"] = "iid"
    """How the training clips are divided among trainers: at random, or by class (non-IID)."""
    slow_trainer: int | None = None
    """Make this trainer a straggler (for experiments and benchmarks)."""
    slow_factor: float = 3.0
    """How much slower the straggler is."""
    log_every: int = 10
    """Log a line every N iterations (trainer 0)."""
    probe_every: int = 0
    """Trainer 0 evaluates its current copy of the model every N iterations (0: never), for time-to-accuracy."""


DATA_READ = ("store", "train_split", "eval_split", "crop", "flip")
"""The --data.* options the parameter server's trainers and the federated clients read: each takes its own share
(:func:`partition`) in a seeded order, crops and flips it (:class:`Augment`) and trains with plain cross-entropy,
without a loader, mixup, CutMix, class balance or shard-order shuffle. Their jobs refuse any other option set."""


def partition(labels: np.ndarray, parts: int, how: str, seed: int) -> list[np.ndarray]:
    """Indices of each trainer's share: a seeded random split, or contiguous runs of classes (non-IID)."""
    if how == "iid":
        order = np.random.default_rng(seed).permutation(len(labels))
        return [np.sort(order[k::parts]) for k in range(parts)]
    order = np.argsort(labels, kind="stable")
    return [np.sort(chunk) for chunk in np.array_split(order, parts)]


def batch_indices(share: np.ndarray, step: int, batch: int, seed: int, trainer: int) -> np.ndarray:
    """The clips of one trainer's iteration: a function of (seed, trainer, step), so any run can recompute it."""
    epoch, offset = divmod(step * batch, len(share))
    order = np.random.default_rng([seed, trainer, epoch]).permutation(len(share))
    picks = [order[(offset + i) % len(share)] for i in range(batch)]
    return share[picks]


@dataclasses.dataclass(frozen=True)
class Augment:
    """The training crop and flip of a worker, seeded per (seed, iteration) so a rerun draws the same."""

    crop: int | None
    flip: bool
    seed: int

    def __call__(self, clips: torch.Tensor, step: int) -> torch.Tensor:
        if self.crop is None and not self.flip:
            return clips
        g = torch.Generator().manual_seed(hash((self.seed, step)) % (2**63))
        return random_crop_flip(clips, self.crop, self.flip, g)


def _batch(dataset: ClipDataset, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[int(i)] for i in indices]
    return torch.stack([c for c, _ in items]), torch.tensor([y for _, y in items])


class Worker:
    """One trainer of the asynchronous/SSP/sync parameter server: pulls, computes gradients, pushes."""

    def __init__(
        self,
        index: int,
        servers: list[str],
        owner: dict[str, int],
        model: torch.nn.Module,
        dataset: ClipDataset,
        share: np.ndarray,
        settings: TrainerSettings,
        seed: int,
        augment: Augment,
        run: RunDir | None = None,
        probe: ClipDataset | None = None,
    ) -> None:
        self.index, self.name = index, f"trainer{index}"
        self.servers, self.owner, self.model, self.dataset = servers, owner, model, dataset
        self.share, self.settings, self.seed, self.augment = share, settings, seed, augment
        self.run_dir = run
        """Where this worker reports its metrics (trainer 0 only)."""
        self.probe = probe
        self.versions = [0] * len(servers)

    def run(self) -> int:
        s = self.settings
        start = max(rpc.rpc_sync(name, srv.remote_clock, args=(self.name,)) for name in self.servers)
        if start:
            log.info("%s resumes at clock %d", self.name, start)
        accumulated = 0
        started = time.perf_counter()
        for step in range(start, s.steps):
            if (step - start) % s.n_fetch == 0:
                self._pull()
            tick = time.perf_counter()
            loss = self._forward_backward(step)
            accumulated += 1
            if accumulated == s.n_push or step == s.steps - 1:
                self._push(step + 1, accumulated)
                accumulated = 0
            if s.slow_trainer == self.index:
                time.sleep((time.perf_counter() - tick) * (s.slow_factor - 1))
            if (
                self.run_dir is not None
                and self.probe is not None
                and s.probe_every
                and (step + 1) % s.probe_every == 0
            ):
                self._probe(step + 1, time.perf_counter() - started)
            if self.run_dir is not None and ((step + 1) % s.log_every == 0 or step + 1 == s.steps):
                rate = (step + 1 - start) / (time.perf_counter() - started)
                row = {"kind": "train", "step": step + 1, "loss": loss, "trainer": self.index, "iterations_per_s": rate}
                self.run_dir.append_metrics({**row, "time": time.time()})
        for name in self.servers:
            rpc.rpc_sync(name, srv.remote_leave, args=(self.name,))
        return s.steps

    def _probe(self, step: int, elapsed: float) -> None:
        assert self.run_dir is not None and self.probe is not None
        self._pull()  # the parameters as the servers hold them now
        result = evaluate_model(self.model, self.probe, self.settings.batch_per_rank, self.augment.crop)
        self.model.train()
        figures = {k: result[k] for k in ("video_top1", "clip_top1")}
        self.run_dir.append_metrics({"kind": "probe", "step": step, "seconds": elapsed, **figures})

    def _pull(self) -> None:
        futures = [rpc.rpc_async(name, srv.remote_pull, args=(self.name,)) for name in self.servers]
        state = {}
        for k, future in enumerate(futures):
            params, self.versions[k] = future.wait()
            state.update(params)
        self.model.load_state_dict(state, strict=False)

    def _forward_backward(self, step: int) -> float:
        idx = batch_indices(self.share, step, self.settings.batch_per_rank, self.seed, self.index)
        clips, labels = _batch(self.dataset, idx)
        loss = F.cross_entropy(self.model(self.augment(clips, step)), labels)
        loss.backward()
        return float(loss.item())

    def _push(self, clock: int, accumulated: int) -> None:
        shards: list[dict[str, torch.Tensor]] = [{} for _ in self.servers]
        for name, p in self.model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            shards[self.owner[name]][name] = grad / accumulated
        futures = [
            rpc.rpc_async(name, srv.remote_push, args=(self.name, shards[k], clock, self.versions[k]))
            for k, name in enumerate(self.servers)
        ]
        for future in futures:
            future.wait()  # SSP and sync hold this until the others catch up
        self.model.zero_grad(set_to_none=True)
