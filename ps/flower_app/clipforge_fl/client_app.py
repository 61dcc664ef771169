"""The ClientApp: local training on the SuperNode's own share of the clips (masked under SecAgg+ when asked)."""

from flwr.client import ClientApp

from clipforge.ps.federated import client, maybe_secagg

app = ClientApp(client_fn=client, mods=[maybe_secagg])
