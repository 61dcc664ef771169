"""Which clips each step takes: a function of the seed and the step, so a resumed run takes the same ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class StepSampler:
    """The sample indices of every (step, micro-batch, data-parallel rank), computed, not replayed.

    Positions run through epochs; each epoch is a permutation (or a class-balanced
    draw) seeded by (seed, epoch). Starting at any step costs nothing.
    """

    def __init__(
        self, labels: np.ndarray, batch: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int, balanced: bool
    ) -> None:
        self.labels, self.batch, self.grad_accum = labels, batch, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.balanced = dp_rank, dp_size, seed, balanced
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, e])
            n = len(self.labels)
            if self.balanced:
                counts = np.bincount(self.labels)
                weights = 1.0 / counts[self.labels]
                self._epochs[e] = rng.choice(n, size=n, replace=True, p=weights / weights.sum())
            else:
                self._epochs[e] = rng.permutation(n)
            self._epochs.pop(e - 2, None)
        return self._epochs[e]

    def indices(self, step: int, micro: int) -> list[int]:
        n = len(self.labels)
        start = ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.batch
        return [int(self._epoch(p // n)[p % n]) for p in range(start, start + self.batch)]

    def batches(self, first_step: int, last_step: int) -> Iterator[list[int]]:
        for step in range(first_step, last_step):
            for micro in range(self.grad_accum):
                yield self.indices(step, micro)
