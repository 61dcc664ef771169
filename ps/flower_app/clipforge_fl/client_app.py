"""The ClientApp: local training on the SuperNode's own share of the clips."""

from flwr.client import ClientApp

from clipforge.ps.federated import client

app = ClientApp(client_fn=client)
