"""The ClientApp: local training on the SuperNode's own share of the clips (masked under SecAgg+ when asked)."""

from flwr.client import ClientApp

from clipforge.ps.federated import client, maybe_clip, maybe_secagg

# SecAgg+ outermost: an update is clipped before it is masked.
app = ClientApp(client_fn=client, mods=[maybe_secagg, maybe_clip])
