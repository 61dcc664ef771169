"""Where a development cluster lives and how it is shaped: its folder, ports, nodes and the paths inside.

Kept apart from the daemons (:mod:`.cluster`) so that the config writer and the accounting provisioner
read the same description without importing the class that starts them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .nodes import NodeNetwork

DEFAULT_DIR = Path(os.environ.get("CLIPFORGE_CLUSTER_DIR", "/tmp/clipforge-slurm"))


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """Where a development cluster lives and how it is shaped."""

    root: Path = DEFAULT_DIR
    cpus: int = 8
    """CPUs the node declares (``config_overrides`` lets it claim more than the host has)."""
    memory_mb: int = 16000
    accounting: bool = True
    """Run slurmdbd + MariaDB so that ``sacct`` (and so submitit's job states) work."""
    ctld_port: int = 6817
    slurmd_port: int = 6818
    dbd_port: int = 6819
    mysql_port: int = 3316
    name: str = "clipforge"
    nodes: int = 1
    """Nodes of the cluster: 1 is the host itself; 2-9 are network namespaces n1..nN on it."""
    subnet: str = "10.77.0"
    """The nodes' /24 when there are several (host .1, node K .1K)."""

    @classmethod
    def beside(cls, nodes: int, subnet: str = "10.77.0"):
        """An N-node cluster with its own folder, ports and name, so it runs beside the default one."""
        return cls(
            root=DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-{nodes}n"),
            nodes=nodes,
            name=f"clipforge{nodes}n",
            ctld_port=6827,
            dbd_port=6829,
            mysql_port=3326,
            subnet=subnet,
        )

    # -- paths ---------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def mysql_socket(self) -> Path:
        return self.root / "mysql" / "mysqld.sock"

    def pid_file(self, daemon: str) -> Path:
        return self.root / "run" / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"

    @property
    def network(self) -> NodeNetwork:
        return NodeNetwork(self.nodes, subnet=self.subnet)

    @property
    def hosts_file(self) -> Path:
        """The ``/etc/hosts`` every node sees: the controller and the nodes by name."""
        return self.root / "etc" / "hosts.nodes"

    def _slurmd_daemons(self) -> list[str]:
        return [f"slurmd-{n}" for n in self.network.names] if self.nodes > 1 else ["slurmd"]

    @property
    def env(self) -> dict[str, str]:
        """What a client needs in its environment to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}
