"""The federated server's fit workflows: Flower's default one with the round's timeout, and SecAgg+'s."""

from __future__ import annotations

import math


def timed_fit_workflow(timeout_s: float):
    """Flower's default fit workflow with the round's timeout.

    Flower's own sends the round without one (``ServerConfig.round_timeout`` reaches only its legacy server),
    so a round would wait for a lost client until the SuperLink declares it gone, two missed 30-second
    heartbeats later. Here its exchange stops at ``timeout_s`` and the round goes on with the answers it has.
    """
    from flwr.server.workflow.default_workflows import default_fit_workflow

    class TimedGrid:
        def __init__(self, grid) -> None:
            self.grid = grid

        def __getattr__(self, name: str):
            return getattr(self.grid, name)

        def send_and_receive(self, messages, *, timeout: float | None = None):
            return self.grid.send_and_receive(messages, timeout=timeout_s if timeout is None else timeout)

    return lambda grid, context: default_fit_workflow(TimedGrid(grid), context)


def registered_only(grid, nodes: set[str]):
    """``grid`` as the server's workflows see it: only the nodes the job registered are there to sample.

    The gate keeps outsiders from registering, and this keeps a node registered by any other way (a user of the
    server's own host, on loopback) out of every round.
    """

    class RegisteredOnly:
        def __getattr__(self, name: str):
            return getattr(grid, name)

        def get_node_ids(self):
            return [node for node in grid.get_node_ids() if str(node) in nodes]

    return RegisteredOnly()


def secagg_shares(sampled: int) -> float:
    """The share of a round's sampled clients that hold a share of each client's key and mask its update pairwise
    with it: all of them (Flower's 1.0) while they are at most 2 log2 n + 2, else 2 log2 n + 1 of the n planned,
    SecAgg+'s bounded neighbourhood (Bell et al., 2020): 9 at 16 clients, 13 at 50, 21 at 1000.

    A share, not a count: Flower applies it to the clients a round actually sampled (fewer when some have not
    connected yet or a node was lost), where a fixed count above them would halt the round.

    With every client the neighbour of every other, each client draws one model-sized pairwise mask per other
    client, and the server one per dropped client's neighbour: Flower's mask generator takes 17 ns a weight
    here (measured), 1.5 s a mask for 86M weights, so about 70 s a client and round at 50 clients.
    """
    bound = 2 * math.ceil(math.log2(max(sampled, 2))) + 1  # odd, as the protocol wants
    return 1.0 if sampled <= bound + 1 else bound / sampled


def secagg_workflow(
    sampled: int, may_drop: float, clipping_range: float, quantization_range: int, max_weight: float, timeout_s: float
):
    """Flower's SecAgg+ fit workflow: each sampled client shares its masks with its neighbours (secagg_shares).

    Each of its four exchanges waits at most the round's timeout: a client that has not answered by then (a
    lost node, noticed by the SuperLink only after two missed 30-second heartbeats) is dropped, and the round
    goes on while enough of the clients' key shares remain to unmask the sum. A client lost after it shared
    its keys (while it trains) is what the protocol tolerates; Flower halts a round that lost one before.

    Flower's workflow only logs that it halted, and its round would then be evaluated and counted with the
    previous global model; here a halted round stops the run instead, so the run directory keeps its last
    real round and a restart resumes from it.
    """
    from flwr.server.workflow import SecAggPlusWorkflow

    class Workflow(SecAggPlusWorkflow):
        def __call__(self, grid, context) -> None:
            self.unmasked = False
            super().__call__(grid, context)
            if not self.unmasked:
                raise RuntimeError(
                    "secure aggregation halted: too few clients answered to unmask the sum of their updates "
                    f"(more than --secagg-may-drop {may_drop} of them dropped, or one dropped before "
                    "sharing its keys); the run keeps its last completed round, and a restart resumes from it"
                )

        def unmask_stage(self, grid, context, state) -> bool:
            self.unmasked = super().unmask_stage(grid, context, state)
            return self.unmasked

    return Workflow(
        num_shares=secagg_shares(sampled),
        reconstruction_threshold=max(1.0 - may_drop, 0.01),  # a share of a client's neighbours
        clipping_range=clipping_range,
        quantization_range=quantization_range,
        max_weight=max_weight,
        timeout=timeout_s,
    )
