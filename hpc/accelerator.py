"""What one accelerator can do at best: its dense bf16 peak, for model FLOPs utilisation (MFU).

The peak comes from the vendor's datasheet, looked up by the device's name
(dense, without sparsity). A device not in the table (a CPU, a GPU newer than
this file) is measured once, with a large matmul in the precision it trains
in, and the figure says so: MFU against a measured matmul rate is a ceiling
the model could reach, not the vendor's number.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

# Dense bf16 tensor-core peaks, TFLOP/s per device. Longer names first: "H100 PCIe" before "H100",
# "A100" before "A10", "L40S" before "L40".
DATASHEET_BF16_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "B100": 1750.0,
    "GH200": 989.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "A30": 165.0,
    "A40": 150.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
    "MI210": 181.0,
}


@dataclasses.dataclass(frozen=True)
class Peak:
    tflops: float
    """Peak TFLOP/s of one device."""
    source: str
    """"datasheet" or "measured" (a large matmul on this device)."""
    device: str
    """The device's name as torch reports it."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"{device.type.upper()} ({threads} thread{'s' if threads > 1 else ''})"


def datasheet_tflops(name: str) -> float | None:
    """The dense bf16 peak of a device by its name, or None when it is not in the table."""
    for key in sorted(DATASHEET_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return DATASHEET_BF16_TFLOPS[key]
    return None


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype a run's matmuls take under each ``--precision``."""


@functools.cache
def peak(device: torch.device, precision: str = "bf16") -> Peak:
    """The peak of ``device``: from the datasheet when its name is known, else measured once in the dtype the
    run's matmuls take under ``precision`` (a CPU with AVX512-BF16 or AMX multiplies bf16 at twice its fp32 rate
    or more: MFU of a bf16 run against an fp32 matmul rate read above 1)."""
    name = device_name(device)
    known = datasheet_tflops(name) if device.type == "cuda" else None
    if known is not None:
        return Peak(known, "datasheet", name)
    dtype = COMPUTE_DTYPES[precision]
    return Peak(matmul_tflops(device, dtype=dtype), f"measured, {precision}", name)


def matmul_tflops(device: torch.device, seconds: float | None = None, dtype: torch.dtype | None = None) -> float:
    """TFLOP/s of square matmuls on ``device``, in ``dtype`` (default: bf16 on a GPU, fp32 on a CPU).

    Timed for ``seconds``: by default half a second on a GPU, and a fifth on a CPU (about ten 1024x1024 matmuls,
    on every thread), where it runs at the start of every run a test suite or a laptop starts. The figure is the
    fastest of the timed groups of four matmuls, not their mean: on a shared node the other processes slow some
    groups, and a peak read low makes MFU read high (above 1, in a busy test suite).
    """
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    seconds = seconds if seconds is not None else 0.5 if device.type == "cuda" else 0.2
    n = 8192 if device.type == "cuda" else _cpu_size(dtype, seconds)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, thread pool
    _sync(device)
    best, start = 0.0, time.perf_counter()
    while True:
        group = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        _sync(device)
        now = time.perf_counter()
        best = max(best, 4 * 2 * n**3 / (now - group) / 1e12)
        if now - start >= seconds:
            return best


def _cpu_size(dtype: torch.dtype, seconds: float) -> int:
    """1024, or 256 where one 1024x1024 matmul in ``dtype`` would take longer than ``seconds``.

    A CPU without fp16 arithmetic (most x86 cores) multiplies fp16 matrices about a hundred times slower than
    fp32 ones: five 1024x1024 fp16 matmuls took 15 s on one core here, at the start of every fp16 run. A 1024
    matmul costs 64 of 256 ones, so one timed 256 matmul tells which size fits.
    """
    a = torch.randn(256, 256, dtype=dtype)
    torch.matmul(a, a)
    start = time.perf_counter()
    torch.matmul(a, a)
    return 1024 if 64 * (time.perf_counter() - start) <= seconds else 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
