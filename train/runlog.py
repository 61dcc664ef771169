"""What rank 0 writes while a run trains: metrics.jsonl, TensorBoard and the progress line, once per log window.

The loop hands over each step's loss as a device tensor and never waits for
it; at the end of a window the losses arrive on the host together (one
transfer, one collective), and every step of the window gets its row in
``metrics.jsonl``, written in one append.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from clipforge.base.logs import Progress
from clipforge.rundir import RunDir

from .objectives import Objective
from .throughput import Throughput

log = logging.getLogger(__name__)


class RunLog:
    """The records of one run on rank 0 (on other ranks every call does nothing)."""

    def __init__(
        self,
        run: RunDir,
        main: bool,
        first_step: int,
        steps: int,
        throughput: Throughput,
        lr: Callable[[], float],
        objective: Objective,
    ) -> None:
        """``objective``: the run's (:mod:`.objectives`), which says how an evaluation reads."""
        self.run, self.main, self.throughput, self._lr, self.objective = run, main, throughput, lr, objective
        self.writer = None
        if main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run.tensorboard), purge_step=first_step or None)
        self.progress = Progress(steps - first_step, "training", unit="step", enabled=main)
        self._window: list[tuple[int, float, float]] = []
        """(step, lr, time) of each step of the window, taken on the host as the step was queued."""

    def step(self, step: int) -> None:
        """A step was queued (its loss arrives with the window's)."""
        if self.main:
            self._window.append((step, self._lr(), time.time()))

    def window(self, losses: list[float]) -> None:
        """The end of a log window: the losses of its steps, in order; one row each, and the progress line."""
        if not self.main:
            return
        rows = [
            {"kind": "train", "step": step, "loss": loss, "lr": lr, "time": at}
            for (step, lr, at), loss in zip(self._window, losses)
        ]
        figures = self.throughput.figures()
        if figures:
            rows.append({"kind": "throughput", "step": rows[-1]["step"], **figures})
        self.run.append_metrics(*rows)
        for row in rows:
            if row["kind"] == "train" and self.writer is not None:
                self.writer.add_scalar("train/loss", row["loss"], row["step"])
                self.writer.add_scalar("train/lr", row["lr"], row["step"])
        if self.writer is not None:
            for key, value in figures.items():
                self.writer.add_scalar(f"throughput/{key}", value, rows[-1]["step"])
        self.progress.update(len(self._window), **self._line(losses[-1], figures))
        self._window = []

    def _line(self, loss: float, figures: dict[str, float]) -> dict[str, str]:
        line = {"loss": f"{loss:.4f}", "lr": f"{self._lr():.2e}"}
        if figures:
            line["clips/s"] = f"{figures['clips_per_s']:.1f}"
            if "tflops" in figures:
                line["TFLOP/s"] = f"{figures['tflops']:.3f}"
            if "mfu" in figures:
                line["MFU"] = f"{figures['mfu']:.1%}"
            line["data-wait"] = f"{figures['data_wait']:.0%}"
        return line

    def checkpoint(self, records: list[dict[str, Any]]) -> None:
        """Checkpoints that finished writing: how long the loop was blocked, how long the write took, its size."""
        if self.main and records:
            self.run.append_metrics(*({"kind": "checkpoint", **r} for r in records))

    def evaluation(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.main:
            return
        self.run.append_metrics({"kind": "eval", "step": step, **metrics})
        log.info("step %d: %s", step, self.objective.describe(metrics))
        if self.writer is not None:
            for key in self.objective.figures:
                self.writer.add_scalar(f"{metrics['split']}/{key}", metrics[key], step)

    def summary(self, step: int, figures: dict[str, Any]) -> None:
        if self.main:
            self.run.append_metrics({"kind": "summary", "step": step, **figures})

    def close(self) -> None:
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
