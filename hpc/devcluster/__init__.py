"""Development tooling, not used by jobs: a real Slurm cluster (one node or several) on this host.

``clipforge cluster up`` and the tests start it; :class:`LocalCluster` is the entry point.
"""

from .cluster import LocalCluster
from .daemons import ClusterError

__all__ = ["ClusterError", "LocalCluster"]
