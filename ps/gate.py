"""The gates of a federation: nginx in front of Flower, so that outsiders reach the Fleet API only, with mutual TLS.

Flower 1.42 serves its Fleet API (SuperNodes), its Control API (``flwr run``,
``flwr supernode register``/``unregister``) and its ServerAppIo API on one
HTTP port, and the Control API asks for no login. Its SuperNode cannot show a
client certificate (``--root-certificates`` "is not a client certificate for
mTLS"). So the SuperLink listens on loopback only, and two nginx programs from
the operating system do the TLS (no TLS of clipforge's own):

- the :class:`FleetGate`, on the server's public address: TLS with the
  federation's server certificate, a client certificate signed by the
  federation's CA required (``ssl_verify_client on``), and only
  ``/v1/fleet/`` forwarded to the SuperLink; every other path is refused (403);
- a :class:`ClientGate` beside each SuperNode, on loopback: the SuperNode
  speaks TLS to it (Flower's SuperNode signs in only over TLS) against a
  self-signed loopback certificate it alone trusts, and the gate opens the TLS
  connection to the server's gate with the client's certificate, verifying the
  server's against the federation's CA.

Flower's SuperNode authentication still runs behind the gate: a request
that passes it must also be signed with a key the job registered.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from clipforge.base.errors import UserError
from clipforge.hpc.distenv import free_port

from . import certs

NGINX = "nginx"
"""The nginx program (Debian's package nginx); clipforge starts its own instances with their own configuration."""

# Large model updates stream through without being buffered to disk, and a round's long exchanges do not time out.
_PROXY = """
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_request_buffering off;
      proxy_buffering off;
      proxy_read_timeout 3600s;
      proxy_send_timeout 3600s;
      proxy_ssl_trusted_certificate {ca};
      proxy_ssl_verify on;
      proxy_ssl_verify_depth 1;
      proxy_ssl_name {name};
      proxy_ssl_server_name on;"""


class GateError(UserError):
    """A gate that could not start; the message names its log."""


def _main_block(folder: Path) -> str:
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    # As root nginx's workers would run as nobody, who cannot write the job's folders: they run as the job's user.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (
        f"daemon off;\nmaster_process on;\nworker_processes 1;\n{user}pid {folder / 'nginx.pid'};\n"
        f"error_log {folder / 'error.log'} info;\nevents {{ worker_connections 1024; }}\n"
    )


def _http_common(folder: Path) -> str:
    return (
        '  log_format gate \'$remote_addr [$time_local] "$request" $status client="$ssl_client_s_dn"\';\n'
        f"  access_log {folder / 'access.log'} gate;\n"
        "  client_max_body_size 0;\n"
        + "".join(f"  {kind}_temp_path {folder / kind.split('_')[0]};\n" for kind in ("client_body", "proxy"))
        + "".join(f"  {kind}_temp_path {folder / kind};\n" for kind in ("fastcgi", "uwsgi", "scgi"))
    )


def _verify_name(host: str) -> str:
    """The name nginx checks the server's certificate for: its names are DNS names and IPs, and nginx matches
    only DNS names, so loopback is checked as localhost (the federation's certificate always covers it)."""
    return "localhost" if host in ("127.0.0.1", "::1") else host


class Stoppable:
    """A program this job started, stopped with SIGTERM (SIGKILL if it lingers); several at once by
    :func:`stop_all`, so that their graceful shutdowns overlap."""

    process: subprocess.Popen

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        self.terminate()
        self.wait_stopped(timeout_s)


def stop_all(programs: list[Stoppable], timeout_s: float = 15.0) -> None:
    """Signal every one of ``programs``, then wait for each."""
    for program in programs:
        program.terminate()
    for program in programs:
        program.wait_stopped(timeout_s)


class Gate(Stoppable):
    """One nginx, its configuration, pid file and logs in ``folder``."""

    def __init__(self, folder: Path, config: str, listen: tuple[str, int]) -> None:
        self.folder, self.listen = Path(folder), listen
        self.folder.mkdir(parents=True, exist_ok=True)
        self.conf = self.folder / "nginx.conf"
        self.conf.write_text(config)
        self.error_log = self.folder / "error.log"
        self.since = self.error_log.stat().st_size if self.error_log.exists() else 0
        argv = [NGINX, "-p", str(self.folder), "-c", str(self.conf), "-e", str(self.error_log)]
        try:
            # In the job's process group, like Flower's programs: whatever ends the job ends the gate too.
            self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            raise GateError(
                "nginx is not installed here, and a federation's TLS gates are nginx: install it (Debian: apt-get "
                "install nginx) and start again"
            ) from None
        self._wait_listening()

    def _wait_listening(self, timeout_s: float = 30.0) -> None:
        host, port = self.listen
        probe = "127.0.0.1" if host in ("0.0.0.0", "") else host
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise GateError(f"nginx ended (exit {self.process.returncode}) at its start; see {self.error_log}")
            try:
                with socket.create_connection((probe, port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.05)
        raise GateError(f"nginx did not listen on {host}:{port} within {timeout_s:.0f} s; see {self.error_log}")

    def port_taken(self) -> bool:
        with open(self.error_log, "rb") as f:
            f.seek(self.since)
            return b"Address already in use" in f.read()

    def errors(self) -> str:
        """What this start of the gate logged (TLS refusals among it)."""
        if not self.error_log.exists():
            return ""
        with open(self.error_log, "rb") as f:
            f.seek(self.since)
            return f.read().decode(errors="replace")


class FleetGate(Gate):
    """The server's gate: mutual TLS on ``listen``, ``/v1/fleet/`` forwarded to the SuperLink on loopback."""

    def __init__(self, keys: Path, listen: tuple[str, int], superlink_port: int, folder: Path) -> None:
        keys = Path(keys).resolve()
        ca = keys / certs.CA_CERT
        proxy = _PROXY.format(ca=ca, name="localhost")
        config = _main_block(Path(folder)) + (
            "http {\n" + _http_common(Path(folder)) + f"  server {{\n    listen {listen[0]}:{listen[1]} ssl;\n"
            f"    ssl_certificate {keys / certs.SERVER_CERT};\n    ssl_certificate_key {keys / certs.SERVER_KEY};\n"
            f"    ssl_client_certificate {ca};\n    ssl_verify_client on;\n    ssl_verify_depth 1;\n"
            "    ssl_protocols TLSv1.2 TLSv1.3;\n"
            f"    location /v1/fleet/ {{\n      proxy_pass https://127.0.0.1:{superlink_port};{proxy}\n    }}\n"
            "    location / { return 403; }\n  }\n}\n"
        )
        super().__init__(folder, config, listen)


class ClientGate(Gate):
    """A client's gate on loopback: TLS in from its SuperNode (:attr:`root`, the certificate the SuperNode trusts),
    mutual TLS out to the server's gate.

    ``port``: where it listens; None: a free one, drawn again if another process binds it first.
    """

    def __init__(self, key: Path, cert: Path, ca: Path, superlink: str, folder: Path, port: int | None = None) -> None:
        folder = Path(folder).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        pem = folder / "client-key.pem"  # nginx reads PEM; the client's key is OpenSSH, as Flower reads it
        certs.write_secret(pem, certs.tls_key_pem(key))
        self.root, loopback_key = certs.loopback_certificate(folder)
        host = superlink.rsplit(":", 1)[0].strip("[]")
        proxy = _PROXY.format(ca=Path(ca).resolve(), name=_verify_name(host))
        for attempt in range(3):
            self.port = port or free_port()
            config = _main_block(folder) + (
                "http {\n" + _http_common(folder) + f"  server {{\n    listen 127.0.0.1:{self.port} ssl;\n"
                f"    ssl_certificate {self.root};\n    ssl_certificate_key {loopback_key};\n"
                f"    location / {{\n      proxy_pass https://{superlink};{proxy}\n"
                f"      proxy_ssl_certificate {Path(cert).resolve()};\n      proxy_ssl_certificate_key {pem};\n"
                "    }\n  }\n}\n"
            )
            try:
                super().__init__(folder, config, ("127.0.0.1", self.port))
                return
            except GateError:
                if port is not None or attempt == 2 or not self.port_taken():
                    raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def refusal(self) -> str | None:
        """Why the server's side refused this client's TLS, in one line, if its log says so."""
        text = self.errors()
        if "upstream SSL certificate verify error" in text or "certificate verify failed" in text:
            return "the server's certificate is not signed by the CA given (--ca): ask the job's owner for its ca.crt"
        if "alert" in text and ("certificate" in text or "handshake" in text):
            return "the server refused this client's certificate: use the client-N.crt the job's owner made for you"
        if "Connection refused" in text or "No route to host" in text or "timed out" in text:
            return "nothing answers at the server's address: check --superlink HOST:PORT and that the job runs"
        return None
