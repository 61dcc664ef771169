"""clipforge's Flower app: the ServerApp and ClientApp are thin; the work is in clipforge.ps.federated."""
