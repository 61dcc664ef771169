"""Everything about the cluster: resources, profiles, executors, the distributed contract, requeue."""
