"""Accounting for a development cluster, so that ``sacct`` (and submitit's job states) work.

A private MariaDB on its own port and socket, its ``slurm`` user and database, and slurmdbd reading
from it; both started by hand (no systemd) and recorded in the cluster's pid files.
"""

from __future__ import annotations

import os
import secrets
import subprocess

from .daemons import ClusterError, port_open, running_pid, wait_for
from .shape import ClusterShape
from .slurmconf import slurm_conf, slurmdbd_conf


def mysql(shape: ClusterShape, sql: str, check: bool = True) -> int:
    """Run ``sql`` as MariaDB's root over the private socket; the exit status."""
    result = subprocess.run(
        ["mariadb", f"--socket={shape.mysql_socket}", "-u", "root", "-e", sql], capture_output=True, text=True
    )
    if check and result.returncode != 0:
        raise ClusterError(f"MariaDB refused {sql[:40]!r}: {result.stderr.strip()}")
    return result.returncode


def start_mariadb(shape: ClusterShape) -> None:
    """Start MariaDB (creating its data folder the first time) with the ``slurm`` user and database."""
    if running_pid(shape, "mariadbd"):
        return
    data = shape.root / "mysql" / "data"
    first = not data.exists()
    shape.mysql_socket.parent.mkdir(parents=True, exist_ok=True)
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
    with open(shape.log_file("mariadbd"), "ab") as out:
        proc = subprocess.Popen(
            [
                "mariadbd",
                "--user=root",
                f"--datadir={data}",
                f"--socket={shape.mysql_socket}",
                f"--port={shape.mysql_port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={shape.root / 'mysql' / 'mariadbd.pid'}",
                "--skip-name-resolve",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    shape.pid_file("mariadbd").write_text(str(proc.pid))
    wait_for(lambda: mysql(shape, "SELECT 1", check=False) == 0, "mariadbd", shape.log_file("mariadbd"), timeout=60)
    password_file = shape.root / "etc" / "dbpass"
    if not password_file.exists():
        password_file.write_text(secrets.token_hex(12))
        password_file.chmod(0o600)
    password = password_file.read_text().strip()
    mysql(
        shape,
        f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';",
    )


def start_slurmdbd(shape: ClusterShape) -> None:
    """Start slurmdbd against the MariaDB of :func:`start_mariadb`."""
    if running_pid(shape, "slurmdbd"):
        return
    dbd_conf = shape.root / "etc" / "slurmdbd.conf"
    password = (shape.root / "etc" / "dbpass").read_text().strip()
    dbd_conf.write_text(slurmdbd_conf(shape, password))
    dbd_conf.chmod(0o600)  # slurmdbd refuses a config that others can read
    shape.conf.write_text(slurm_conf(shape))
    env = dict(os.environ, SLURM_CONF=str(shape.conf), SLURMDBD_CONF=str(dbd_conf))
    subprocess.run(["slurmdbd"], env=env, check=True)
    wait_for(lambda: port_open(shape.dbd_port), "slurmdbd", shape.log_file("slurmdbd"), timeout=30)
