"""Several Slurm nodes on one host: a network namespace, hostname and ``/etc/hosts`` per node.

Each node ``nK`` gets its own network namespace (``<prefix>-nK``) joined to a
bridge on the host by a veth pair, an address ``<subnet>.1K`` (the host is
``<subnet>.1``), and, when a daemon is started in it, its own UTS namespace
(hostname ``nK``) and a mount namespace in which only ``/etc/hosts`` is
replaced. ``/tmp``, ``/sys`` and cgroups stay shared with the host, so a job's
files are where the tests look for them.

Processes are started with ``nsenter --net`` + ``unshare``, not ``ip netns
exec``: the latter remounts ``/sys``, and slurmd then fails with "No
filesystem mounted on /sys/fs/cgroup".
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from clipforge.base.errors import UserError


class NodeNetworkError(UserError):
    """The host cannot make the nodes' network; the message names what is missing."""


@dataclasses.dataclass(frozen=True)
class NodeNetwork:
    nodes: int
    prefix: str = "cf"
    """Names of the bridge (``<prefix>br0``), veths (``<prefix>vK``) and namespaces (``<prefix>-nK``)."""
    subnet: str = "10.77.0"
    """The /24 the nodes live in: the host is .1, node K is .1K (K up to 9)."""

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def names(self) -> list[str]:
        return [f"n{k}" for k in range(1, self.nodes + 1)]

    def address(self, node: str) -> str:
        return f"{self.subnet}.1{node[1:]}"

    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def node_range(self) -> tuple[str, str]:
        """Slurm's forms: ``n[1-3]`` and ``10.77.0.[11-13]``."""
        last = self.nodes
        return f"n[1-{last}]", f"{self.subnet}.[11-1{last}]"

    # -- checks ------------------------------------------------------------------
    def check_host(self) -> None:
        """Refuse, in one line, a host that cannot make the network (or an address range already taken)."""
        if not 2 <= self.nodes <= 9:
            raise NodeNetworkError(f"--nodes {self.nodes}: a cluster on one host has 2 to 9 nodes (or 1, without this)")
        if os.geteuid() != 0:
            raise NodeNetworkError("a multi-node cluster makes network namespaces, which needs root; run it as root")
        missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
        if missing:
            raise NodeNetworkError(
                f"a multi-node cluster needs {', '.join(missing)}: apt-get install iproute2 util-linux"
            )
        try:
            ipaddress.ip_network(f"{self.subnet}.0/24")
        except ValueError:
            raise NodeNetworkError(f"subnet {self.subnet!r} is not the first three parts of an IPv4 address") from None
        if self.exists():
            return  # ours, from an earlier up
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        if f" {self.subnet}." in used:
            raise NodeNetworkError(
                f"addresses {self.subnet}.0/24 are already in use on this host; choose another with --subnet"
            )

    def exists(self) -> bool:
        return Path(f"/sys/class/net/{self.bridge}").exists()

    # -- lifecycle -------------------------------------------------------------
    def up(self, hosts_file: Path, controller: str) -> None:
        """The bridge, a namespace and veth per node, and the nodes' hosts file; idempotent."""
        self.check_host()
        if not self.exists():
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        present = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        for node in self.names:
            ns, veth = self.namespace(node), self.veth(node)
            if ns in present:
                continue
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", f"{self.host_address} {controller}"]
        lines += [f"{self.address(n)} {n}" for n in self.names]
        # The IPv4-mapped forms silence torch's "hostname of the client socket cannot be retrieved".
        lines += [f"::ffff:{self.address(n)} {n}" for n in self.names]
        hosts_file.write_text("\n".join(lines) + "\n")

    def start(self, node: str, command: list[str], hosts_file: Path, log: Path) -> None:
        """Run ``command`` as node ``node``: its network, its hostname, its ``/etc/hosts``."""
        _ip("link", "set", self.veth(node), "up")  # back after a crash
        script = f'hostname {node} && mount --bind "$0" /etc/hosts && exec "$@"'
        argv = ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--uts", "--mount"]
        argv += ["--propagation", "slave", "bash", "-c", script, str(hosts_file), *command]
        with open(log, "ab") as out:
            result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise NodeNetworkError(f"node {node}: {command[0]} did not start (exit {result.returncode}); see {log}")

    def pids(self, node: str) -> list[int]:
        """Every process in node ``node``'s network namespace (its slurmd, steps and tasks)."""
        result = subprocess.run(["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True)
        return [int(p) for p in result.stdout.split()]

    def veth(self, node: str) -> str:
        return f"{self.prefix}v{node[1:]}"

    def crash(self, node: str) -> list[int]:
        """Crash node ``node``: cut its link, then SIGKILL every process on it; returns their pids.

        The link goes first, as in a real crash: peers on the other nodes must hear nothing,
        not the resets the host's kernel sends for a killed process's sockets (which would
        stop their ranks at once, before Slurm has noticed the node).
        """
        _ip("link", "set", self.veth(node), "down")
        return self.kill(node)

    def kill(self, node: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of node ``node`` at once; returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def down(self) -> None:
        """Kill what runs in the namespaces, then remove the veths, namespaces and bridge."""
        present = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        for node in self.names:
            ns = self.namespace(node)
            if ns not in present:
                continue
            self.kill(node, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self.pids(node) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.kill(node)
            subprocess.run(["ip", "link", "del", self.veth(node)], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.exists():
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        remaining = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip()
        # `ip netns add` leaves a self bind-mount on /run/netns (same device: os.path.ismount misses it).
        mounts = Path("/proc/self/mounts").read_text().split("\n")
        if not remaining and any(line.split()[1:2] == ["/run/netns"] for line in mounts):
            subprocess.run(["umount", "/run/netns"], capture_output=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NodeNetworkError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
