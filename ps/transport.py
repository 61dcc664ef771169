"""How clients' updates travel: fp32 weights, or their change from the round's global weights in bf16 or fp16.

Half the bytes up, at a rounding error the benchmark measures (README, "Federated training").
"""

from __future__ import annotations

import numpy as np
import torch


def encode(weights: np.ndarray, start: np.ndarray, transport: str) -> np.ndarray:
    """A client's update to one array for a half-precision transport: its change from the round's global weights,
    rounded by torch to bf16 (sent as the raw 16 bits, which numpy has no type for) or fp16. Integer arrays go
    as they are."""
    if not np.issubdtype(weights.dtype, np.floating):
        return weights
    change = torch.from_numpy(np.asarray(weights, dtype=np.float32) - np.asarray(start, dtype=np.float32))
    if transport == "bf16":
        return change.to(torch.bfloat16).view(torch.int16).numpy()
    return change.to(torch.float16).numpy()


def decode(sent: np.ndarray, start: np.ndarray, transport: str) -> np.ndarray:
    """The fp32 weights a half-precision update stands for: the round's global weights plus the change."""
    if not np.issubdtype(start.dtype, np.floating):
        return sent
    if transport == "bf16":
        change = torch.from_numpy(np.ascontiguousarray(sent)).view(torch.bfloat16).float().numpy()
    else:
        change = sent.astype(np.float32)
    return (start.astype(np.float32) + change).astype(start.dtype)
