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


def half_transport(inner):
    """A Flower strategy around ``inner``: clients send their updates in bf16 or fp16 (half the bytes up), and it
    turns them back into fp32 weights before ``inner`` averages them.

    Flower's strategies average the weights they are given and none takes a compressed update, so this wrapper
    does the decoding and passes every other call through.
    """
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    class HalfTransport(Strategy):
        def __init__(self) -> None:
            self.start: list[np.ndarray] = []

        def initialize_parameters(self, client_manager):
            return inner.initialize_parameters(client_manager)

        def configure_fit(self, server_round, parameters, client_manager):
            self.start = parameters_to_ndarrays(parameters)
            return inner.configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            for _, res in results:
                transport = str(res.metrics.get("transport", "fp32"))
                if transport != "fp32":
                    sent = parameters_to_ndarrays(res.parameters)
                    res.parameters = ndarrays_to_parameters([decode(a, g, transport) for a, g in zip(sent, self.start)])
            return inner.aggregate_fit(server_round, results, failures)

        def configure_evaluate(self, server_round, parameters, client_manager):
            return inner.configure_evaluate(server_round, parameters, client_manager)

        def aggregate_evaluate(self, server_round, results, failures):
            return inner.aggregate_evaluate(server_round, results, failures)

        def evaluate(self, server_round, parameters):
            return inner.evaluate(server_round, parameters)

    return HalfTransport()
