"""A real Slurm cluster on this host, of one node or several, for development and tests.

``clipforge cluster up`` installs what is missing from Debian, writes a config
under one directory, and starts munged, MariaDB + slurmdbd (for ``sacct``),
slurmctld and slurmd by hand (the machines we develop on have no systemd).
Everything it starts is recorded as a pid file in that directory, so ``down``
stops exactly what ``up`` started, and ``up`` is idempotent.

With ``--nodes N`` (2 to 9) every node ``n1..nN`` is a slurmd in its own
network namespace, with its own hostname and address (:mod:`.nodes`), and
slurmctld runs on the host: jobs span nodes for real, their ranks find each
other over the nodes' addresses, and a node can be killed as a crash would.

Clients find the cluster through ``SLURM_CONF``; without it every command
fails with "DNS SRV lookup failed".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from clipforge.hpc.processes import process_alive

from .accounting import start_mariadb, start_slurmdbd
from .daemons import ClusterError, install_packages, running_pid, wait_for
from .shape import ClusterShape
from .slurmconf import slurm_conf

log = logging.getLogger(__name__)

DEBIAN_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "libpmix-dev"]
NODE_PACKAGES = ["iproute2", "util-linux"]  # ip, nsenter, unshare: the nodes of a multi-node cluster
ACCOUNTING_PACKAGES = ["slurmdbd", "mariadb-server"]
# Each daemon, in start order; "down" stops them in reverse.
DAEMONS = ["munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"]


@dataclasses.dataclass(frozen=True)
class LocalCluster(ClusterShape):
    """A development cluster of this shape that can be brought up, inspected, crashed node by node and stopped."""

    # -- lifecycle -------------------------------------------------------------
    def up(self) -> None:
        """Install, configure and start whatever is not yet running."""
        self._refuse_other_shape()
        nodes = NODE_PACKAGES if self.nodes > 1 else []
        install_packages(DEBIAN_PACKAGES + nodes + (ACCOUNTING_PACKAGES if self.accounting else []))
        if self.nodes > 1:
            self.network.check_host()
        for sub in ("etc", "state", "spool", "log", "run", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "etc" / "nodes").write_text(str(self.nodes))
        self._start_munged()
        if self.accounting:
            start_mariadb(self)
            start_slurmdbd(self)
        self.conf.write_text(slurm_conf(self))
        if self.nodes > 1:
            self.network.up(self.hosts_file, socket.gethostname().split(".")[0])
        self._start("slurmctld", ["slurmctld", "-f", str(self.conf)])
        wait_for(lambda: self._client_ok(["scontrol", "ping"]), "slurmctld", self.log_file("slurmctld"), timeout=30)
        if self.nodes == 1:
            self._start("slurmd", ["slurmd", "-f", str(self.conf)])
        else:
            for node in self.network.names:
                self._start_node(node)
        wait_for(self._node_ready, "slurmd", self.log_file("slurmd"), timeout=60)
        log.info("Slurm cluster %r is up with %d node(s): export SLURM_CONF=%s", self.name, self.nodes, self.conf)

    def _start_node(self, node: str) -> None:
        if running_pid(self, f"slurmd-{node}"):
            return
        for sub in ("spool", "tmp"):
            (self.root / sub / node).mkdir(parents=True, exist_ok=True)
        self._clear_stale_steps(self.root / "spool" / node)
        command = ["slurmd", "-f", str(self.conf), "-N", node]
        self.network.start(node, command, self.hosts_file, self.log_file(f"slurmd-{node}-start"))
        daemon = f"slurmd-{node}"
        wait_for(lambda: running_pid(self, daemon) is not None, daemon, self.log_file(daemon), timeout=20)

    def start_node(self, node: str) -> None:
        """Start node ``node``'s slurmd again (after :meth:`kill_node`); Slurm returns it to service."""
        self._start_node(node)

    def kill_node(self, node: str) -> list[int]:
        """Crash node ``node`` for real: cut its link, SIGKILL its slurmd and every step and task on it.

        Returns the pids killed. :meth:`start_node` brings it back.
        """
        if self.nodes == 1:
            raise ClusterError("kill_node needs a multi-node cluster (clipforge cluster up --nodes N)")
        return self.network.crash(node)

    def down(self) -> None:
        """Stop every daemon that ``up`` started, and the nodes' network (state stays for the next ``up``)."""
        slurmds = self._slurmd_daemons() if self.recorded_nodes() == self.nodes else []
        for daemon in [*slurmds, *reversed([d for d in DAEMONS if d != "slurmd"])]:
            pid = running_pid(self, daemon)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 20
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
            self.pid_file(daemon).unlink(missing_ok=True)
        if self.nodes > 1:
            self.network.down()
            for node in self.network.names:
                self._clear_stale_steps(self.root / "spool" / node)

    def status(self) -> dict[str, bool]:
        """Which daemons are running, by name (one slurmd per node)."""
        wanted = DAEMONS if self.accounting else [d for d in DAEMONS if d not in ("mariadbd", "slurmdbd")]
        wanted = [d for d in wanted if d != "slurmd"] + self._slurmd_daemons()
        return {d: running_pid(self, d) is not None for d in wanted}

    def recorded_nodes(self) -> int:
        """How many nodes the cluster in this folder was last brought up with."""
        try:
            return int((self.root / "etc" / "nodes").read_text())
        except (FileNotFoundError, ValueError):
            return 1

    def _refuse_other_shape(self) -> None:
        recorded = self.recorded_nodes()
        if recorded != self.nodes and running_pid(self, "slurmctld"):
            raise ClusterError(
                f"a {recorded}-node cluster is running in {self.root}; stop it first (clipforge cluster down"
                f"{f' --nodes {recorded}' if recorded > 1 else ''})"
            )

    @staticmethod
    def _clear_stale_steps(spool: Path) -> None:
        """Step sockets and PMIx folders of steps that died with their node stop a new slurmd's steps."""
        if not spool.is_dir():
            return
        for stale in [*spool.glob("*.socket"), *spool.glob("pmix.*")]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def is_up(self) -> bool:
        return all(self.status().values()) and self._node_ready()

    def _start_munged(self) -> None:
        if running_pid(self, "munged"):
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
            shutil.chown(key, "munge", "munge")
        sock_dir = self.munge_socket.parent
        sock_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(sock_dir, "munge", "munge")
        sock_dir.chmod(0o755)
        # munged refuses a pid or log file in a directory that others can write to,
        # so both live next to its socket, owned by munge.
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                f"--socket={self.munge_socket}",
                f"--pid-file={sock_dir / 'munged.pid'}",
                f"--log-file={sock_dir / 'munged.log'}",
                f"--seed-file={sock_dir / 'munged.seed'}",
                "--force",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        wait_for(lambda: (sock_dir / "munged.pid").exists(), "munged", self.log_file("munged"), timeout=10)
        shutil.copy(sock_dir / "munged.pid", self.pid_file("munged"))

    def _start(self, daemon: str, argv: list[str]) -> None:
        if running_pid(self, daemon):
            return
        result = subprocess.run(argv, env=dict(os.environ, **self.env), capture_output=True, text=True)
        if result.returncode != 0:
            raise ClusterError(
                f"{daemon} did not start ({result.stderr.strip() or 'no message'}); see {self.log_file(daemon)}"
            )
        wait_for(lambda: running_pid(self, daemon) is not None, daemon, self.log_file(daemon), timeout=20)

    # -- config ------------------------------------------------------------------

    def _client_ok(self, argv: list[str]) -> bool:
        result = subprocess.run(argv, env=dict(os.environ, **self.env), capture_output=True, text=True)
        return result.returncode == 0

    def _node_ready(self) -> bool:
        result = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=dict(os.environ, **self.env), capture_output=True, text=True
        )
        states = result.stdout.split()
        return (
            result.returncode == 0
            and bool(states)
            and all(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states)
        )
