"""A throwaway CA and one certificate for `duet up --secure`: made at start with
`cryptography`, valid for a week, written into duet up's private 0700 folder and gone when it
stops. The one certificate serves the router and workers and is the gateway's client
certificate (server and client usage), for 127.0.0.1, ::1, localhost and the --host address."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

VALID_FOR = dt.timedelta(days=7)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path


def make_certificates(folder: Path, hosts: Iterable[str], name: str = "duet-up") -> CertFiles:
    """A CA and a certificate it signed for `hosts` (IP addresses or DNS names), as PEM files
    in `folder` (the key readable by this user only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def subject(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + VALID_FOR
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(subject(f"{name} CA")).issuer_name(subject(f"{name} CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(subject(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_alt_names(x509, hosts)), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = CertFiles(folder / "grpc.crt", folder / "grpc.key", folder / "grpc-ca.crt")
    _write(files.ca, ca_cert.public_bytes(pem))
    _write(files.cert, cert.public_bytes(pem))
    _write(files.key, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


def _alt_names(x509, hosts: Iterable[str]) -> list:
    names, seen = [], set()
    for host in ("127.0.0.1", "::1", "localhost", *hosts):
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
