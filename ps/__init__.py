"""Parameter-server training over torch.distributed.rpc (asynchronous, SSP, sync), and federated training on Flower."""
