"""Which clips each step takes: a function of the seed and the step, so a resumed run takes the same ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class StepSampler:
    """The sample indices of every (step, micro-batch, data-parallel rank), computed, not replayed.

    Positions run through epochs; each epoch is a permutation (or a class-balanced
    draw) seeded by (seed, epoch). Starting at any step costs nothing.

    With ``shards`` and ``positions`` (the shard and store position of every item)
    and a ``window`` of clips, an epoch
    is reordered for locality: shards in a seeded random order, each shard's clips
    in file order, then shuffled within consecutive windows of ``window`` clips
    (their boundaries shifted by a seeded phase each epoch, so neighbours differ
    from epoch to epoch). A batch then reads a few runs of neighbouring chunks from
    one or two shards, and a reader's shard handles are reused instead of reopened,
    where a global shuffle over more shards than a process keeps open reopens a
    shard for nearly every clip. Mixing is that of a shuffle buffer of ``window``
    clips; every clip is still seen once an epoch, and the order is still a
    function of (seed, epoch).
    """

    def __init__(
        self,
        labels: np.ndarray,
        batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        balanced: bool,
        shards: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        window: int = 0,
    ) -> None:
        self.labels, self.batch, self.grad_accum = labels, batch, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.balanced = dp_rank, dp_size, seed, balanced
        self.shards, self.positions, self.window = shards, positions, window
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, e])
            n = len(self.labels)
            if self.balanced:
                counts = np.bincount(self.labels)
                weights = 1.0 / counts[self.labels]
                order = rng.choice(n, size=n, replace=True, p=weights / weights.sum())
            else:
                order = rng.permutation(n)
            if self.shards is not None and self.window > 0:
                order = self._local(order, rng)
            self._epochs[e] = order
            self._epochs.pop(e - 2, None)
        return self._epochs[e]

    def _local(self, order: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``order`` regrouped: shards shuffled, file order inside each, shuffled within windows."""
        assert self.shards is not None and self.positions is not None
        rank_of_shard = np.empty(int(self.shards.max()) + 1, np.int64)
        rank_of_shard[rng.permutation(len(rank_of_shard))] = np.arange(len(rank_of_shard))
        order = order[np.lexsort((self.positions[order], rank_of_shard[self.shards[order]]))]
        window = (np.arange(len(order)) + rng.integers(self.window)) // self.window
        return order[np.lexsort((rng.random(len(order)), window))]

    def indices(self, step: int, micro: int) -> list[int]:
        n = len(self.labels)
        start = ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.batch
        return [int(self._epoch(p // n)[p % n]) for p in range(start, start + self.batch)]

    def batches(self, first_step: int, last_step: int) -> Iterator[list[int]]:
        for step in range(first_step, last_step):
            for micro in range(self.grad_accum):
                yield self.indices(step, micro)
