"""How busy a training run keeps its accelerators: clips/s, TFLOP/s, MFU and the share of time waiting for data.

The meter times the loop from outside. :meth:`Throughput.timed` wraps the
loader's iterator and adds up the time the loop spends blocked in it: the
share of step time the accelerator had nothing to do because the input
pipeline was behind. The loop does not wait for the device step by step; it
synchronises at the edges of its log windows and tells the meter how many
steps ended there (:meth:`steps_done`), so wall time is the accelerator's time.

The first step (allocator warm-up, kernel selection, compilation) counts in
the windows the log prints but not in :meth:`summary`, the run's steady rate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from clipforge.hpc.accelerator import Peak, peak

T = TypeVar("T")
log = logging.getLogger(__name__)


class Throughput:
    def __init__(self, clips_per_step: int, flops_per_clip: float | None, peak: Peak | None, devices: int) -> None:
        self.clips_per_step = clips_per_step
        self.flops_per_clip = flops_per_clip
        """Forward FLOPs of one clip; training counts forward + backward as three times that."""
        self.peak = peak
        self.devices = devices
        self.waited = 0.0
        self.window = _Span()
        self.steady = _Span()
        self.steps = 0

    @classmethod
    def of_run(
        cls, clips_per_step: int, flops: float | None, device, devices: int, main: bool, precision: str = "bf16"
    ) -> Throughput:
        """The meter of a training run; rank 0 (``main``) logs the peak its MFU divides by."""
        # A device missing from the datasheet table is measured, once, on rank 0 only (only rank 0 logs), in the
        # dtype the run's matmuls take.
        device_peak = peak(device, precision) if flops and main else None
        if device_peak is not None:
            log.info(
                "MFU against %.3g TFLOP/s per device (%s, %s)",
                device_peak.tflops,
                device_peak.device,
                device_peak.source,
            )
        return cls(clips_per_step, flops, device_peak, devices)

    def timed(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` unchanged, with the time spent waiting for each one added to the data-wait figures."""
        it = iter(items)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.waited += time.perf_counter() - start
            yield item

    def steps_done(self, n: int) -> None:
        """``n`` more optimizer steps have finished on the device (the caller has synchronised with it).

        The steady rate starts after the first call: make it for the run's first step alone.
        """
        if n <= 0:
            return
        now, waited = time.perf_counter(), self.waited
        first = self.steps == 0
        self.steps += n
        self.window.add(now, waited, n)
        if first:
            self.steady.start(now, waited)
        else:
            self.steady.add(now, waited, n)

    def start(self) -> None:
        now = time.perf_counter()
        self.window.start(now, self.waited)

    def figures(self) -> dict[str, float]:
        """The figures of the steps since the last call (the log line), then a new window starts."""
        out = self._figures(self.window)
        self.window.start(time.perf_counter(), self.waited)
        return out

    def summary(self) -> dict[str, Any]:
        """Steady-state figures of the whole run, without its first step; empty for a run of one step."""
        out: dict[str, Any] = dict(self._figures(self.steady)) if self.steady.steps else {}
        if out and self.peak is not None:
            out.update(peak_tflops=self.peak.tflops, peak_source=self.peak.source, device=self.peak.device)
        return out

    def _figures(self, span: _Span) -> dict[str, float]:
        if not span.steps or span.elapsed <= 0:
            return {}
        clips_s = span.steps * self.clips_per_step / span.elapsed
        out = {"clips_per_s": clips_s, "data_wait": min(span.waited / span.elapsed, 1.0)}
        if self.flops_per_clip:
            tflops = 3 * self.flops_per_clip * clips_s / 1e12
            out["tflops"] = tflops
            if self.peak is not None:
                out["mfu"] = tflops / (self.peak.tflops * self.devices)
        return out


class _Span:
    """Steps, wall time and data wait since a start point."""

    def __init__(self) -> None:
        self.steps, self.elapsed, self.waited = 0, 0.0, 0.0
        self._t0 = self._w0 = 0.0

    def start(self, now: float, waited: float) -> None:
        self.steps, self.elapsed, self.waited = 0, 0.0, 0.0
        self._t0, self._w0 = now, waited

    def add(self, now: float, waited: float, steps: int = 1) -> None:
        self.steps += steps
        self.elapsed, self.waited = now - self._t0, waited - self._w0


def peak_memory_gib(device) -> float:
    """The most GPU memory this process's tensors held (on CPUs: the process's peak resident size)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
