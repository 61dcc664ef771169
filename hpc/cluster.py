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
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from clipforge.base.errors import UserError

from .nodes import NodeNetwork

log = logging.getLogger(__name__)

DEFAULT_DIR = Path(os.environ.get("CLIPFORGE_CLUSTER_DIR", "/tmp/clipforge-slurm"))
DEBIAN_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "libpmix-dev"]
NODE_PACKAGES = ["iproute2", "util-linux"]  # ip, nsenter, unshare: the nodes of a multi-node cluster
ACCOUNTING_PACKAGES = ["slurmdbd", "mariadb-server"]
# Each daemon, in start order; "down" stops them in reverse.
DAEMONS = ["munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"]


class ClusterError(UserError):
    """The local cluster could not be brought up; the message says what to look at."""


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """Where the single-node cluster lives and how it is shaped."""

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
    def beside(cls, nodes: int, subnet: str = "10.77.0") -> LocalCluster:
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
            self._start_mariadb()
            self._start_slurmdbd()
        self._write_slurm_conf()
        if self.nodes > 1:
            self.network.up(self.hosts_file, socket.gethostname().split(".")[0])
        self._start("slurmctld", ["slurmctld", "-f", str(self.conf)])
        self._wait_for(lambda: self._client_ok(["scontrol", "ping"]), "slurmctld", timeout=30)
        if self.nodes == 1:
            self._start("slurmd", ["slurmd", "-f", str(self.conf)])
        else:
            for node in self.network.names:
                self._start_node(node)
        self._wait_for(self._node_ready, "slurmd", timeout=60)
        log.info("Slurm cluster %r is up with %d node(s): export SLURM_CONF=%s", self.name, self.nodes, self.conf)

    def _start_node(self, node: str) -> None:
        if self._pid(f"slurmd-{node}"):
            return
        for sub in ("spool", "tmp"):
            (self.root / sub / node).mkdir(parents=True, exist_ok=True)
        self._clear_stale_steps(self.root / "spool" / node)
        command = ["slurmd", "-f", str(self.conf), "-N", node]
        self.network.start(node, command, self.hosts_file, self.log_file(f"slurmd-{node}-start"))
        self._wait_for(lambda: self._pid(f"slurmd-{node}") is not None, f"slurmd-{node}", timeout=20)

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
            pid = self._pid(daemon)
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
        return {d: self._pid(d) is not None for d in wanted}

    def recorded_nodes(self) -> int:
        """How many nodes the cluster in this folder was last brought up with."""
        try:
            return int((self.root / "etc" / "nodes").read_text())
        except (FileNotFoundError, ValueError):
            return 1

    def _refuse_other_shape(self) -> None:
        recorded = self.recorded_nodes()
        if recorded != self.nodes and self._pid("slurmctld"):
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

    # -- daemons ---------------------------------------------------------------
    def _start_munged(self) -> None:
        if self._pid("munged"):
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
        self._wait_for(lambda: (sock_dir / "munged.pid").exists(), "munged", timeout=10)
        shutil.copy(sock_dir / "munged.pid", self.pid_file("munged"))

    def _start_mariadb(self) -> None:
        if self._pid("mariadbd"):
            return
        data = self.root / "mysql" / "data"
        first = not data.exists()
        self.mysql_socket.parent.mkdir(parents=True, exist_ok=True)
        if first:
            subprocess.run(
                [
                    "mariadb-install-db",
                    "--user=root",
                    f"--datadir={data}",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        with open(self.log_file("mariadbd"), "ab") as out:
            proc = subprocess.Popen(
                [
                    "mariadbd",
                    "--user=root",
                    f"--datadir={data}",
                    f"--socket={self.mysql_socket}",
                    f"--port={self.mysql_port}",
                    "--bind-address=127.0.0.1",
                    f"--pid-file={self.root / 'mysql' / 'mariadbd.pid'}",
                    "--skip-name-resolve",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file("mariadbd").write_text(str(proc.pid))
        self._wait_for(lambda: self._mysql("SELECT 1", check=False) == 0, "mariadbd", timeout=60)
        password_file = self.root / "etc" / "dbpass"
        if not password_file.exists():
            password_file.write_text(secrets.token_hex(12))
            password_file.chmod(0o600)
        password = password_file.read_text().strip()
        self._mysql(
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
        )

    def _start_slurmdbd(self) -> None:
        if self._pid("slurmdbd"):
            return
        dbd_conf = self.root / "etc" / "slurmdbd.conf"
        password = (self.root / "etc" / "dbpass").read_text().strip()
        dbd_conf.write_text(
            _lines(
                AuthType="auth/munge",
                AuthInfo=f"socket={self.munge_socket}",
                DbdHost="localhost",
                DbdPort=self.dbd_port,
                SlurmUser="root",
                StorageType="accounting_storage/mysql",
                StorageHost="127.0.0.1",
                StoragePort=self.mysql_port,
                StorageUser="slurm",
                StoragePass=password,
                StorageLoc="slurm_acct_db",
                PidFile=self.pid_file("slurmdbd"),
                LogFile=self.log_file("slurmdbd"),
            )
        )
        dbd_conf.chmod(0o600)  # slurmdbd refuses a config that others can read
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._write_slurm_conf()
        subprocess.run(["slurmdbd"], env=dict(env, SLURMDBD_CONF=str(dbd_conf)), check=True)
        self._wait_for(lambda: _port_open(self.dbd_port), "slurmdbd", timeout=30)

    def _start(self, daemon: str, argv: list[str]) -> None:
        if self._pid(daemon):
            return
        result = subprocess.run(argv, env=dict(os.environ, **self.env), capture_output=True, text=True)
        if result.returncode != 0:
            raise ClusterError(
                f"{daemon} did not start ({result.stderr.strip() or 'no message'}); see {self.log_file(daemon)}"
            )
        self._wait_for(lambda: self._pid(daemon) is not None, daemon, timeout=20)

    # -- config ------------------------------------------------------------------
    def _write_slurm_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        multi = self.nodes > 1
        settings: dict[str, object] = dict(
            ClusterName=self.name,
            SlurmctldHost=f"{host}({self.network.host_address})" if multi else host,
            SlurmctldPort=self.ctld_port,
            SlurmdPort=self.slurmd_port,
            SlurmUser="root",
            SlurmdUser="root",
            AuthType="auth/munge",
            CredType="cred/munge",
            # cred_expire=5: a requeued job restarts in ~7 s instead of ~140 s.
            AuthInfo=f"socket={self.munge_socket},cred_expire=5",
            StateSaveLocation=self.root / "state",
            # %n: each node's own spool, pid and log file; they share the host's filesystem.
            SlurmdSpoolDir=self.root / "spool" / ("%n" if multi else ""),
            SlurmctldPidFile=self.pid_file("slurmctld"),
            SlurmdPidFile=self.pid_file("slurmd-%n" if multi else "slurmd"),
            SlurmctldLogFile=self.log_file("slurmctld"),
            SlurmdLogFile=self.log_file("slurmd-%n" if multi else "slurmd"),
            # No cgroups in our containers: track processes by their parent pids.
            ProctrackType="proctrack/linuxproc",
            TaskPlugin="task/none",
            JobContainerType="job_container/none",
            SelectType="select/cons_tres",
            SelectTypeParameters="CR_Core",
            # Lets the node declare more CPUs than the host has, so `srun -n 8` works on 2 cores.
            SlurmdParameters="config_overrides",
            # PMIx needs libpmix-dev, or slurmd cannot load mpi/pmix.
            MpiDefault="pmix",
            SchedulerParameters="sched_interval=5",
            JobRequeue=1,
            ReturnToService=2,
            MinJobAge=86400,
            KillWait=10,
            InactiveLimit=0,
            JobAcctGatherType="jobacct_gather/none",
        )
        if multi:
            settings.update(
                # PMIx makes a per-job folder under TmpFS; with a shared /tmp the second node
                # fails with 'Cannot create directory "/tmp/spmix_appdir_...": File exists'.
                TmpFS=self.root / "tmp" / "%n",
                # A dead node is NOT_RESPONDING after ~8 s and DOWN (its jobs requeued) after
                # ~15 s; lower values do not help: each ping round takes about 7 s.
                SlurmdTimeout=5,
                MessageTimeout=5,
                KillWait=2,
                SchedulerParameters="sched_interval=2",
            )
        if self.accounting:
            settings.update(
                AccountingStorageType="accounting_storage/slurmdbd",
                AccountingStorageHost="localhost",
                AccountingStoragePort=self.dbd_port,
                # With slurmdbd, the "password" names the private munge socket.
                AccountingStoragePass=self.munge_socket,
                # AccountingStorageEnforce=none is fatal on 22.05: leave it out.
            )
        text = _lines(**settings)
        names, addresses = self.network.node_range() if multi else (host, "127.0.0.1")
        text += (
            f"NodeName={names} NodeAddr={addresses} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN\n"
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"
            f"PartitionName=batch Nodes={names} Default=NO MaxTime=INFINITE State=UP\n"
        )
        self.conf.write_text(text)

    # -- small things ------------------------------------------------------------
    def _pid(self, daemon: str) -> int | None:
        try:
            pid = int(self.pid_file(daemon).read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        return pid if process_alive(pid) else None

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

    def _mysql(self, sql: str, check: bool = True) -> int:
        result = subprocess.run(
            ["mariadb", f"--socket={self.mysql_socket}", "-u", "root", "-e", sql], capture_output=True, text=True
        )
        if check and result.returncode != 0:
            raise ClusterError(f"MariaDB refused {sql[:40]!r}: {result.stderr.strip()}")
        return result.returncode

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.5)
        raise ClusterError(f"{what} did not come up within {timeout:.0f} s; see {self.log_file(what)}")


def install_packages(packages: list[str]) -> None:
    """apt-get install the Debian packages whose files are missing (needs root)."""
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"missing Debian packages {' '.join(missing)}: install them as root and retry")
    log.info("installing %s", " ".join(missing))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, check=True, capture_output=True)


def _lines(**settings: object) -> str:
    return "".join(f"{k}={v}\n" for k, v in settings.items())


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
