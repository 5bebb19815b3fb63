"""Certificates for TLS tests, made with ``cryptography``: a CA, a server's, an island's, and a stranger's."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _cert(subject, issuer_key, issuer_name, key, *, ca=False, san=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(d: Path) -> Path:
    """In ``d``: a CA (ca.pem/.key), a server certificate for localhost and 127.0.0.1 (server), an island's
    (client), and another CA with an island certificate it signed (other-ca, other-client)."""
    d.mkdir(parents=True, exist_ok=True)

    def write(name, cert, key):
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "atoll test CA")])
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    write("ca", ca, ca_key)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coordinator")]),
        ca_key,
        ca_name,
        srv_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    write("server", srv, srv_key)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "island-a")]), ca_key, ca_name, cli_key)
    write("client", cli, cli_key)
    other_key = ec.generate_private_key(ec.SECP256R1())  # another CA, and an island certificate it signed
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    write("other-ca", _cert(other_name, other_key, other_name, other_key, ca=True), other_key)
    stray_key = ec.generate_private_key(ec.SECP256R1())
    stray = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "island-x")]), other_key, other_name, stray_key)
    write("other-client", stray, stray_key)
    return d
