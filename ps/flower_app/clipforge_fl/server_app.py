"""The ServerApp: FedAvg rounds of clipforge's model, a checkpoint of the global model after each."""

from flwr.server import ServerApp

from clipforge.ps.federated import serve

app = ServerApp()
app.main()(serve)
