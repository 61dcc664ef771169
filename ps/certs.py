"""The keys and certificates of a federation: a CA, the server's TLS certificate, one key pair per client.

Made with the ``cryptography`` package, never by hand. The server's gate
(:mod:`gate`, in front of Flower's SuperLink) serves TLS with a certificate the
CA signed for its host names, and admits only clients that show a certificate
the same CA signed (mutual TLS). Every client holds one elliptic-curve key pair:
its certificate is for that key, and Flower's SuperNode authentication checks
the same key against the public halves the job registered. Nothing secret needs
to travel from a client to the server.

Private keys are created with mode 600 (``os.open`` with ``O_CREAT | O_EXCL``),
never written first and narrowed afterwards: under a umask of 022 a key written
with the default mode is readable by every user of the host until its chmod.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
from pathlib import Path

from clipforge.base.errors import UserError

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"


class CertError(UserError):
    """Keys that cannot be made or used as asked."""


def client_key(folder: Path, index: int) -> Path:
    """The private key of client ``index`` (OpenSSH format, as Flower's SuperNode reads it)."""
    return Path(folder) / f"client-{index}.key"


def client_public_key(folder: Path, index: int) -> Path:
    return Path(folder) / f"client-{index}.key.pub"


def client_cert(folder: Path, index: int) -> Path:
    """Client ``index``'s TLS certificate (for its own key), which the server's gate asks for."""
    return Path(folder) / f"client-{index}.crt"


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a file that is mode 600 from its creation, then move it into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def tls_key_pem(key_file: Path) -> bytes:
    """A client's private key (OpenSSH, as Flower reads it) in PKCS#8 PEM, as TLS libraries read it."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_ssh_private_key(Path(key_file).read_bytes(), None)
    except (OSError, ValueError) as bad:
        raise CertError(f"{key_file}: not a client key made by clipforge fl certs ({bad})") from None
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_certs(folder: Path, clients: int, hosts: tuple[str, ...] | None = None) -> list[Path]:
    """A CA, the server's certificate for ``hosts`` and ``clients`` client key pairs in ``folder``; the files made.

    An existing CA is kept (so clients added later trust the same server), and so is the server's certificate
    while it covers ``hosts``; otherwise a new one from the same CA covers its old names and ``hosts``.
    Without ``hosts``: the certificate there, or a new one for localhost and 127.0.0.1.
    Existing client keys are kept too.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if clients < 0:
        raise CertError(f"--clients is {clients}; give the number of client key pairs to make, 0 or more")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    made: list[Path] = []

    def private_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def write(path: Path, data: bytes, secret: bool = False) -> None:
        if secret:
            write_secret(path, data)
        else:
            path.write_bytes(data)
        made.append(path)

    if not (folder / CA_CERT).exists():
        ca_key = ec.generate_private_key(ec.SECP384R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clipforge federation CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )  # digital signature, certificate and CRL signing
            .sign(ca_key, hashes.SHA256())
        )
        write(folder / CA_KEY, private_pem(ca_key), secret=True)
        write(folder / CA_CERT, ca.public_bytes(serialization.Encoding.PEM))
    ca_key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
    ca = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    covered = server_hosts(folder)
    if hosts is None:
        hosts = tuple(sorted(covered)) or ("localhost", "127.0.0.1")
    if not set(hosts) <= covered:
        # A new address for the server (a Slurm job's node): a new server certificate from the same CA,
        # for the old names and the new; clients trust the CA, so their keys stay as they are.
        hosts = tuple(dict.fromkeys([*hosts, *sorted(covered)]))
        key = ec.generate_private_key(ec.SECP384R1())
        names = [
            x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in dict.fromkeys(hosts)
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(folder / SERVER_KEY, private_pem(key), secret=True)
        write(folder / SERVER_CERT, cert.public_bytes(serialization.Encoding.PEM))
    for i in range(clients):
        if not client_key(folder, i).exists():
            key = ec.generate_private_key(ec.SECP384R1())
            openssh = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            )
            public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            write(client_key(folder, i), openssh, secret=True)
            write(client_public_key(folder, i), public + b"\n")
        if client_cert(folder, i).exists():
            continue
        # The certificate is for the key the SuperNode signs in with: one key pair per client, for both.
        key = serialization.load_ssh_private_key(client_key(folder, i).read_bytes(), None)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"client-{i}")]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(client_cert(folder, i), cert.public_bytes(serialization.Encoding.PEM))
    return made


def loopback_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate and its key for 127.0.0.1, made in ``folder`` for one client gate's loopback side
    (Flower's SuperNode signs in only over TLS); the SuperNode trusts this certificate alone. Its files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    cert_file, key_file = folder / "loopback.crt", folder / "loopback.key"
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clipforge client gate (loopback)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    write_secret(
        key_file,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_file, key_file


def ensure(folder: Path, clients: int, host: str) -> None:
    """Keys for every client and a server certificate valid for ``host``, the node the clients reach."""
    hosts = ("localhost", "127.0.0.1", host)
    missing = not (Path(folder) / CA_CERT).exists() or not client_cert(folder, clients - 1).exists()
    if missing or not set(hosts) <= server_hosts(folder):
        if (Path(folder) / CA_CERT).exists() and not (Path(folder) / CA_KEY).exists():
            raise CertError(
                f"the server certificate in {folder} is not valid for {host}, where this job's server runs, and "
                f"the CA key is not there to make one: run `clipforge fl certs {folder} --host {host}` where it is"
            )
        make_certs(folder, clients, hosts)


def server_hosts(folder: Path) -> set[str]:
    """The names and addresses the server's certificate in ``folder`` is valid for (none without one)."""
    from cryptography import x509

    path = Path(folder) / SERVER_CERT
    if not path.exists():
        return set()
    names = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return {str(n) for n in names.value.get_values_for_type(x509.DNSName)} | {
        str(n) for n in names.value.get_values_for_type(x509.IPAddress)
    }


def handout(folder: Path, clients: int) -> list[str]:
    """What to hand to whom, one line each."""
    f = Path(folder)
    lines = [
        f"server (SuperLink): {f / CA_CERT}, {f / SERVER_CERT}, {f / SERVER_KEY} (keep {f / CA_KEY} offline)",
        f"server, to register the clients: {', '.join(str(client_public_key(f, i)) for i in range(clients))}",
    ]
    lines += [
        f"client {i} (clipforge fl join): {f / CA_CERT}, {client_key(f, i)} and {client_cert(f, i)} (its own only)"
        for i in range(clients)
    ]
    return lines


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
