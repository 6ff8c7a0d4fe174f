"""A private certificate authority and a broker certificate, made with ``cryptography``.

``astraflow broker start --secure`` keeps both in its state directory: ``ca.pem`` (the CA
certificate, what clients trust: ``kafka.security.ca_location``), ``ca.key`` and
``broker.pem`` (the broker's PKCS8 key followed by its certificate chain, the layout of
Kafka's ``ssl.keystore.type=PEM``), the keys mode 0600. The broker certificate names
``DNS:localhost`` and ``IP:127.0.0.1``: without the IP, clients that bootstrap from
``127.0.0.1`` (and the broker's own connection to itself) fail hostname verification.
"""

from __future__ import annotations

import datetime as dt
import os
from ipaddress import ip_address
from pathlib import Path

from astraflow.kafka.embedded import TlsFiles, tls_files

CA_DAYS = 3650
BROKER_DAYS = 825
RENEW_BEFORE_DAYS = 30  # a broker certificate this close to expiry is made again


def write_private(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600 from creation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    os.chmod(path, 0o600)


def _name(common: str):
    from cryptography.x509 import Name, NameAttribute
    from cryptography.x509.oid import NameOID

    return Name([NameAttribute(NameOID.ORGANIZATION_NAME, "AstraFlow embedded broker"),
                 NameAttribute(NameOID.COMMON_NAME, common)])


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def make_ca(files: TlsFiles, days: int = CA_DAYS) -> None:
    """A new CA key and self-signed certificate into ``files.ca_key`` and ``files.ca``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("AstraFlow embedded broker CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    write_private(files.ca_key, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    files.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_leaf(files: TlsFiles, out: Path, common: str = "localhost",
              dns: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",),
              days: int = BROKER_DAYS, not_before: dt.datetime | None = None) -> None:
    """A key and a certificate signed by the CA of ``files`` for ``dns`` and ``ips``,
    written to ``out`` (mode 0600) as key, certificate, CA certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(common))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pem += cert.public_bytes(serialization.Encoding.PEM)
    pem += ca_cert.public_bytes(serialization.Encoding.PEM)
    write_private(out, pem)


def expires_in_days(pem_file: Path) -> float:
    """Days until the first certificate in ``pem_file`` expires (negative: expired)."""
    from cryptography import x509

    data = pem_file.read_bytes()
    start = data.index(b"-----BEGIN CERTIFICATE-----")
    cert = x509.load_pem_x509_certificate(data[start:])
    return (cert.not_valid_after_utc - _now()).total_seconds() / 86400


def ensure_broker_tls(folder: Path, log=print, dns: tuple[str, ...] = ("localhost",)
                      ) -> TlsFiles:
    """The CA and broker certificate (for ``dns`` and ``IP:127.0.0.1``) in ``folder``:
    kept when they exist (clients trust that CA), made when missing; the broker
    certificate again when it nears expiry."""
    files = tls_files(folder)
    if not (files.ca.exists() and files.ca_key.exists()):
        make_ca(files)
        log(f"made a certificate authority for the embedded broker: {files.ca}")
        files.broker.unlink(missing_ok=True)
    if not files.broker.exists() or expires_in_days(files.broker) < RENEW_BEFORE_DAYS:
        make_leaf(files, files.broker, common=dns[0], dns=dns)
    return files


__all__ = ["TlsFiles", "ensure_broker_tls", "expires_in_days", "make_ca", "make_leaf",
           "tls_files", "write_private"]
