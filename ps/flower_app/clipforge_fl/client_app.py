"""The ClientApp: local training on the SuperNode's own share of the clips (masked under SecAgg+ when asked).

Flower starts a ClientApp process for every message. Under SecAgg+ three of a round's four messages are
key exchanges that the mod answers on its own, so torch and the trainer are imported only when a message
reaches the client: the fit.
"""

from flwr.client import ClientApp
from flwr.client.mod import fixedclipping_mod, secaggplus_mod


def client(context):
    """This SuperNode's trainer (clipforge.ps.federated.client), imported on the first fit."""
    from clipforge.ps.federated import client as trainer

    return trainer(context)


def maybe_clip(message, context, call_next):
    """Flower's fixedclipping_mod (clip the update) when the run asks for client-level DP under SecAgg+, where the
    server sees only the sum (otherwise the server clips each update itself)."""
    if bool(context.run_config.get("dp", False)):
        return fixedclipping_mod(message, context, call_next)
    return call_next(message, context)


def maybe_secagg(message, context, call_next):
    """Flower's secaggplus_mod when the run asks for SecAgg+, the plain exchange otherwise."""
    if bool(context.run_config.get("secagg", False)):
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


# SecAgg+ outermost: an update is clipped before it is masked.
app = ClientApp(client_fn=client, mods=[maybe_secagg, maybe_clip])
