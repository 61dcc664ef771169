"""What the federation's server checks of every client update before it aggregates it, and how it aggregates.

Clients may be hostile: one admitted client could otherwise send NaN (every
global weight NaN), arrays of the wrong shapes (the ServerApp raises, the run
ends), or a huge update with a claimed example count of 10^9 (FedAvg weighs by
the claim). So, in the server's own process, before any aggregation:

- an update must have the global model's arrays, shapes and dtypes (its
  transport's, for half-precision updates), and every value must be finite;
  one that fails is refused, its client named in the log and the round's
  metrics, and the round goes on with the others (the global model stays as
  it was when none passes);
- it comes from a node the job registered, and weighs by the examples the job
  assigned that node (its share), not by what it claims (a claim that differs
  is logged and ignored);
- clipping, where differential privacy asks for it, is the server's
  (:func:`aggregator` wraps Flower's central-clipping strategy) unless
  SecAgg+ hides the single updates, and the aggregation may be robust
  (Flower's trimmed mean, median or Krum).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from .transport import decode

Aggregation = Literal["fedavg", "trimmed-mean", "median", "krum"]
TRIM = 0.2
"""The trimmed mean's cut: this share of the values at each end, per weight (Flower's FedTrimmedAvg beta)."""


def problem(arrays: list[np.ndarray], start: list[np.ndarray], transport: str) -> str | None:
    """What is wrong with an update of ``arrays`` to the global ``start`` sent as ``transport`` (None: nothing)."""
    if len(arrays) != len(start):
        return f"{len(arrays)} arrays where the model has {len(start)}"
    for k, (a, g) in enumerate(zip(arrays, start)):
        wanted = g.dtype
        if transport != "fp32" and np.issubdtype(g.dtype, np.floating):
            wanted = np.dtype(np.int16) if transport == "bf16" else np.dtype(np.float16)
        if a.shape != g.shape or a.dtype != wanted:
            return f"array {k} is {a.dtype}{list(a.shape)} where the model's is {wanted}{list(g.shape)}"
    return None


def not_finite(arrays: list[np.ndarray]) -> str | None:
    """What is wrong with an update whose floating values are not all finite (None: nothing)."""
    if all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f"):
        return None
    return "values that are not finite (NaN or infinity)"


def checked(
    inner,
    start_of_round,
    clients: dict[str, int],
    examples: list[float],
    transport: str,
    refused: dict,
    secagg: bool = False,
    equal: bool = False,
):
    """A Flower strategy around ``inner`` that checks, decodes and re-weighs each update before ``inner`` aggregates.

    ``start_of_round``: a callable giving the round's global arrays; ``clients``: the node ids the job registered
    (as Flower's client proxies name them) and the client each is; ``examples``: the examples the job assigned each
    client, which its update weighs by (each weighs the same with ``equal``: client-level DP's plain mean);
    ``refused``: filled with each round's refused clients, for its metrics row. ``secagg``: SecAgg+ hands
    every result the one weighted mean it unmasked (float64, each client weighed by its own count, capped at the
    plan's max weight): that mean is checked instead, and cast to the model's dtypes.
    """
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    class Checked(Strategy):
        def initialize_parameters(self, client_manager):
            return inner.initialize_parameters(client_manager)

        def configure_fit(self, server_round, parameters, client_manager):
            start_of_round(parameters_to_ndarrays(parameters))
            return inner.configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            start = start_of_round()
            if secagg:
                return self.secure_mean(server_round, results, failures, start)
            accepted, refused[server_round] = [], []
            for proxy, res in results:
                node = str(proxy.cid)
                who = f"client {clients[node]} (node {node})" if node in clients else f"node {node}"
                why, arrays = None, None
                sent = str(res.metrics.get("transport", "fp32"))
                if node not in clients:
                    why = "a node this job did not register"
                elif sent != transport:
                    why = f"sent as {sent}, where the federation's transport is {transport}"
                else:
                    try:  # Flower reads .npy bytes without pickles; a hostile payload may still not parse
                        arrays = parameters_to_ndarrays(res.parameters)
                    except Exception as bad:  # noqa: BLE001 - any payload that does not parse is refused alike
                        why = f"unreadable ({type(bad).__name__})"
                if why is None:
                    why = problem(arrays, start, transport)
                if why is None and transport != "fp32":
                    arrays = [decode(a, g, transport) for a, g in zip(arrays, start)]
                why = why or not_finite(arrays)
                if why is not None:  # printed: the ServerApp's output is the run's log
                    print(f"round {server_round}: the update of {who} is refused: {why}", flush=True)
                    refused[server_round].append(clients.get(node, node))
                    continue
                assigned = examples[clients[node]]
                if res.num_examples != assigned:
                    print(
                        f"round {server_round}: {who} claims {res.num_examples} examples; the job assigned it "
                        f"{assigned:g}, and its update weighs {1 if equal else assigned:g}",
                        flush=True,
                    )
                res.num_examples = 1 if equal else assigned
                res.parameters = ndarrays_to_parameters(arrays)
                accepted.append((proxy, res))
            if not accepted:
                print(
                    f"round {server_round}: no update passed the checks: the global model stays as it was", flush=True
                )
                return None, {}
            return inner.aggregate_fit(server_round, accepted, failures)

        def secure_mean(self, server_round, results, failures, start):
            refused[server_round] = []
            if not results:
                return None, {}
            arrays = parameters_to_ndarrays(results[0][1].parameters)
            if len(arrays) == len(start):
                arrays = [(a if g.dtype.kind == "f" else np.rint(a)).astype(g.dtype) for a, g in zip(arrays, start)]
            why = problem(arrays, start, "fp32")
            why = why or not_finite(arrays)
            if why is not None:
                print(f"round {server_round}: the securely aggregated update is refused: {why}", flush=True)
                refused[server_round] = sorted(clients.get(str(p.cid), str(p.cid)) for p, _ in results)
                return None, {}
            for _, res in results:
                res.parameters = ndarrays_to_parameters(arrays)
            return inner.aggregate_fit(server_round, results, failures)

        def configure_evaluate(self, server_round, parameters, client_manager):
            return inner.configure_evaluate(server_round, parameters, client_manager)

        def aggregate_evaluate(self, server_round, results, failures):
            return inner.aggregate_evaluate(server_round, results, failures)

        def evaluate(self, server_round, parameters):
            return inner.evaluate(server_round, parameters)

    return Checked()


def aggregator(name: Aggregation, proximal_mu: float, clients: int, **common):
    """Flower's strategy for ``name``: FedAvg (FedProx with a proximal mu), the coordinate-wise trimmed mean, the
    median, or Krum (the one update nearest its neighbours, assuming one hostile client)."""
    from flwr.server.strategy import FedAvg, FedMedian, FedProx, FedTrimmedAvg, Krum

    if name == "fedavg":
        return FedProx(proximal_mu=proximal_mu, **common) if proximal_mu > 0 else FedAvg(**common)
    if name == "trimmed-mean":
        return FedTrimmedAvg(beta=TRIM, **common)
    if name == "median":
        return FedMedian(**common)
    return Krum(num_malicious_clients=max(1, (clients - 3) // 2), num_clients_to_keep=0, **common)
