"""Flower's deployment engine as processes: a SuperLink with TLS and SuperNode authentication, SuperNodes, runs.

Flower does the federated work (the Fleet API over HTTPS, SuperNode
authentication, its strategies and SecAgg+); this module only starts its
programs the way a job needs them and reads their answers. The SuperLink
listens on loopback only; outsiders reach its Fleet API through the job's
:class:`~clipforge.ps.gate.FleetGate`, and every SuperNode reaches that gate
through a :class:`~clipforge.ps.gate.ClientGate` of its own (mutual TLS). Each process gets a
``FLWR_HOME`` of its own (where Flower keeps its config and the apps it
installs) and the environment's ``bin`` on ``PATH``: the SuperLink and the
SuperNodes start Flower's other programs by name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from clipforge.base.errors import UserError
from clipforge.hpc.distenv import free_port

from . import certs
from .gate import ClientGate, FleetGate, Stoppable

log = logging.getLogger(__name__)

APP = Path(__file__).resolve().parent / "flower_app"
"""The Flower app (ServerApp and ClientApp) that ``flwr run`` bundles and sends to the SuperNodes."""
BIN = Path(sys.executable).parent


class FlowerError(UserError):
    """A federation that could not start or run; the message names the log to read."""


def environment(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def wait_for_line(
    log_file: Path, pattern: str, timeout_s: float, process: subprocess.Popen | None = None, after: int = 0
) -> str:
    """The first line of ``log_file`` past byte ``after`` that matches ``pattern``, once it is there."""
    expression = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log_file.exists():
            with open(log_file, "rb") as f:
                f.seek(after)
                text = f.read().decode(errors="replace")
            for line in text.splitlines():
                if expression.search(line):
                    return line
        if process is not None and process.poll() is not None:
            raise FlowerError(f"{log_file.stem} ended (exit {process.returncode}) before it was ready; see {log_file}")
        time.sleep(0.2)
    raise FlowerError(f"{log_file.stem} was not ready within {timeout_s:.0f} s; see {log_file}")


class Process(Stoppable):
    """One of Flower's programs, its output in a log file (a pipe would be held open by its children); SIGTERM
    stops it, and Flower's programs stop the ones they started."""

    def __init__(self, name: str, argv: list[str], home: Path, logs: Path) -> None:
        self.name, self.log = name, logs / f"{name}.log"
        logs.mkdir(parents=True, exist_ok=True)
        self.since = self.log.stat().st_size if self.log.exists() else 0
        """Where this start's lines begin in the log (a restarted job appends to the same file)."""
        with open(self.log, "ab") as out:
            # In the job's process group: whatever ends the job (Slurm, a SIGKILL of the group) ends them too.
            self.process = subprocess.Popen(argv, env=environment(home), stdout=out, stderr=subprocess.STDOUT)

    def port_taken(self) -> bool:
        """Whether this start ended because its port was already bound."""
        with open(self.log, "rb") as f:
            f.seek(self.since)
            return b"address already in use" in f.read()


class SuperLink(Process):
    """The server: Flower's SuperLink on loopback, and its gate on the job's address, which admits only clients
    with a certificate from the federation's CA and forwards only the Fleet API."""

    def __init__(self, keys: Path, port: int, work: Path, host: str = "127.0.0.1", listen: str | None = None) -> None:
        """``port``: the gate's; ``host``: where clients on this host reach it; ``listen``: the address the gate
        serves on (default: ``host``; ``0.0.0.0`` for SuperNodes on other nodes)."""
        self.keys, self.work = Path(keys), Path(work)
        self.fleet_address = f"{host}:{port}"
        """Where SuperNodes connect (through their own gates): the job's gate."""
        inner = free_port()
        self.address = f"127.0.0.1:{inner}"
        """The SuperLink itself, for the job's own ``flwr`` commands: loopback only."""
        argv = [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(self.keys / certs.CA_CERT)]
        argv += [
            "--ssl-certfile",
            str(self.keys / certs.SERVER_CERT),
            "--ssl-keyfile",
            str(self.keys / certs.SERVER_KEY),
        ]
        argv += ["--enable-supernode-auth", "--disable-runtime-dependency-installation"]
        argv += ["--host", "127.0.0.1", "--port", str(inner)]
        super().__init__("superlink", argv, self.work / "superlink-home", self.work / "logs")
        wait_for_line(self.log, r"Uvicorn running on https://", 120, self.process, self.since)
        try:
            self.gate = FleetGate(self.keys, (listen or host, port), inner, self.work / "gate")
        except BaseException:  # no gate to stop yet: the SuperLink alone
            Stoppable.terminate(self)
            Stoppable.wait_stopped(self)
            raise
        home = self.work / "cli-home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "federation"\n\n[superlink.federation]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.keys / certs.CA_CERT}"\n'
        )

    def terminate(self) -> None:
        self.gate.terminate()
        super().terminate()

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        self.gate.wait_stopped(timeout_s)
        super().wait_stopped(timeout_s)

    def cli(self, *args: str, timeout_s: float = 120) -> str:
        """``flwr ARGS`` against this SuperLink; its standard output."""
        argv = [str(BIN / "flwr"), *args]
        result = subprocess.run(
            argv, env=environment(self.work / "cli-home"), capture_output=True, text=True, timeout=timeout_s
        )
        if result.returncode:
            message = (result.stdout + result.stderr).strip().splitlines() or ["no message"]
            raise FlowerError(f"flwr {args[0]} {args[1] if len(args) > 1 else ''}: {message[-1]}")
        return result.stdout

    def register(self, public_key: Path) -> int:
        """Admit the SuperNode holding the private half of ``public_key``; its node id."""
        answer = json.loads(self.cli("supernode", "register", str(public_key), "federation", "--format", "json"))
        if "node-id" not in answer:
            raise FlowerError(f"{public_key} could not be registered with the SuperLink: {answer}")
        return int(answer["node-id"])

    def run(self, config: dict[str, object], stall_s: float, heartbeat: Path) -> tuple[int, str]:
        """Run the clipforge app with ``config`` (its run config) to the end; its run id and final status.

        One ``flwr log --stream`` follows the run into ``logs/run-<id>.log`` and ends when the run does: polling
        ``flwr ls`` instead starts a Python process each time, a core's worth of CPU taken from the clients.
        The run is given up when its ServerApp's ``heartbeat`` has not been touched for ``stall_s``: a watchdog
        on a live server, not a deadline for the whole run, which a thousand rounds with slow evaluations would
        pass while every round is on time (each round is bounded by its own timeout).
        """
        override = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
        answer = self.cli("run", str(APP), "federation", "--format", "json", "--run-config", override)
        run_id = int(json.loads(answer)["run-id"])
        argv = [str(BIN / "flwr"), "log", str(run_id), "federation", "--stream"]
        watch = Watchdog(heartbeat, stall_s)
        with open(self.work / "logs" / f"run-{run_id}.log", "wb") as out:
            stream = subprocess.Popen(argv, env=environment(self.work / "cli-home"), stdout=out, stderr=out)
            while stream.poll() is None and not watch.stalled():
                try:
                    stream.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            if stream.poll() is None:
                stream.kill()
                stream.wait()
        status = self.status(run_id)
        while not status.startswith("finished") and not watch.stalled():  # the stream broke off early
            time.sleep(5.0)
            status = self.status(run_id)
        return run_id, status

    def status(self, run_id: int) -> str:
        """The run's status as ``flwr ls`` gives it (``finished:completed`` once it ended well)."""
        runs = json.loads(self.cli("ls", "federation", "--run-id", str(run_id), "--format", "json"))["runs"]
        return str(runs[0]["status"])

    def refusals(self) -> list[str]:
        """The lines in which the SuperLink refused a SuperNode (an unknown key, or none)."""
        with open(self.log, "rb") as f:
            f.seek(self.since)
            text = f.read().decode(errors="replace")
        return [line for line in text.splitlines() if "ApiError:200" in line]


class Watchdog:
    """Whether a heartbeat file (federated.HEARTBEAT) has gone untouched for longer than ``stall_s``: a beat
    older than the watchdog (a previous start's) does not count."""

    def __init__(self, path: Path, stall_s: float) -> None:
        self.path, self.stall_s, self.started = Path(path), stall_s, time.time()

    def stalled(self) -> bool:
        try:
            beat = self.path.stat().st_mtime
        except FileNotFoundError:
            beat = self.started
        return time.time() - max(beat, self.started) > self.stall_s


class SuperNode(Process):
    """A client: signs in with its own key, through its own gate, which shows its certificate to the server's gate
    and trusts only a server certificate from the federation's CA."""

    def __init__(
        self,
        index: int,
        key: Path,
        cert: Path,
        ca: Path,
        superlink: str,
        node_config: dict[str, object],
        port: int | None,
        work: Path,
    ) -> None:
        """``superlink``: the server's gate, HOST:PORT; ``port``: the SuperNode's runtime API's; None: a free one,
        drawn again if another process binds it first."""
        self.gate = ClientGate(key, cert, ca, superlink, Path(work) / f"supernode-{index}-gate")
        config = " ".join(f"{k}={json.dumps(v)}" for k, v in node_config.items())
        # To its own gate, which shows the client's certificate to the server (Flower's SuperNode shows none).
        argv = [str(BIN / "flower-supernode"), "--superlink", self.gate.address]
        argv += ["--root-certificates", str(self.gate.root)]
        argv += ["--auth-supernode-private-key", str(key), "--node-config", config]
        self.argv = [*argv, "--max-retries", "3", "--max-wait-time", "60"]
        self.folders = Path(work) / f"supernode-{index}-home", Path(work) / "logs"
        self.any_port, self.port = port is None, port or free_port()
        try:
            super().__init__(f"supernode-{index}", [*self.argv, "--port", str(self.port)], *self.folders)
        except BaseException:
            self.gate.stop()
            raise

    def wait_ready(self, timeout_s: float = 120) -> None:
        for attempt in range(3):
            try:
                wait_for_line(self.log, r"SuperNode ID: \d+", timeout_s, self.process, self.since)
                return
            except FlowerError:
                # A port free when drawn can be bound by another process before the SuperNode binds it.
                if not self.any_port or attempt == 2 or self.process.poll() is None or not self.port_taken():
                    raise
            self.port = free_port()
            super().__init__(self.name, [*self.argv, "--port", str(self.port)], *self.folders)

    def terminate(self) -> None:
        super().terminate()
        self.gate.terminate()

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        super().wait_stopped(timeout_s)
        self.gate.wait_stopped(timeout_s)

    def gave_up(self) -> bool:
        """Whether it stopped reaching the server (the federation ended, or its server is gone): Flower's SuperNode
        then logs that it gives up, but its process and the ones it started stay."""
        with open(self.log, "rb") as f:
            f.seek(self.since)
            return b"Giving up reconnection" in f.read()

    def refusal(self) -> str:
        """Why this SuperNode could not join, in one line, from its log and its gate's."""
        said = self.gate.refusal()
        if said is not None:
            return said
        with open(self.log, "rb") as f:
            f.seek(self.since)
            text = f.read().decode(errors="replace")
        if "Status/400" in text or "400 Bad Request" in text:
            return "the server's gate refused this site's certificate: use the client-N.crt the job's owner made"
        if "Status/403" in text:
            return "the address answers, but not as a federation's Fleet API: check --superlink"
        if "No SuperNode found with the given public key" in text or "Failed to activate SuperNode" in text:
            return "the job did not register this key: check that --key is the client-N.key the job's owner sent"
        return f"see {self.log} and {self.gate.error_log}"


def note(work: Path, name: str, job: str | None, restarts: int, value: str) -> None:
    """A note on the shared file system from the server task to the client tasks of the same job start."""
    tmp = work / f".{name}.json.tmp"
    tmp.write_text(json.dumps({"job": job, "restarts": restarts, "value": value}))
    tmp.replace(work / f"{name}.json")


def wait_note(work: Path, name: str, job: str | None, restarts: int, timeout_s: float | None) -> str | None:
    """The value of the server task's note ``name`` for this job start, once it is there (None after the timeout)."""
    path, deadline = work / f"{name}.json", None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        try:
            note = json.loads(path.read_text())
            if note["job"] == job and note["restarts"] == restarts:
                return str(note["value"])
        except (OSError, ValueError, KeyError):
            pass  # not written yet, or a previous job's
        time.sleep(0.5)
    return None
