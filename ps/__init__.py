"""Parameter-server training over torch.distributed.rpc (asynchronous, SSP, sync, federated averaging)."""
