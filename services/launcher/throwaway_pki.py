"""A throwaway CA and the certificates it signs, made with `cryptography`: `duet up` makes one
at start (valid for a week, in its private 0700 folder, gone when it stops) and issues every
child a certificate naming its role and id (shared/security/identity.py); `duet k8s-secrets`
makes one for the role-wide Secrets of the Kubernetes manifests. The CA's key is never written:
once the certificates are issued nobody can sign another."""
from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from shared.security.identity import Identity

VALID_FOR = dt.timedelta(days=7)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class IssuedPem:
    cert: bytes
    key: bytes


class ThrowawayCA:
    """An ECDSA P-256 CA in memory that issues server+client certificates for identities."""

    def __init__(self, name: str = "duet-up", valid_for: dt.timedelta = VALID_FOR):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        now = dt.datetime.now(dt.timezone.utc)
        self._start, self._end = now - dt.timedelta(minutes=5), now + valid_for
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = _subject(f"{name} CA")
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(self._start).not_valid_after(self._end)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))

    @property
    def ca_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, identity: Identity) -> IssuedPem:
        """A certificate (both usages: every service is a server, a client, or both) whose
        subject alternative names are the identity's URI and DNS names."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.UniformResourceIdentifier(identity.uri), *(x509.DNSName(d) for d in identity.dns_names)]
        cert = (x509.CertificateBuilder().subject_name(_subject(identity.uri)).issuer_name(self._cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self._start).not_valid_after(self._end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(self._key, hashes.SHA256()))
        pem = serialization.Encoding.PEM
        return IssuedPem(cert.public_bytes(pem),
                         key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def make_certificates(folder: Path, identities: dict[str, Identity], name: str = "duet-up") -> dict[str, CertFiles]:
    """A throwaway CA and one certificate per entry of `identities` (file stem -> identity),
    as PEM files in `folder`: <stem>.crt, <stem>.key (readable by this user only) and the
    shared grpc-ca.crt."""
    ca = ThrowawayCA(name)
    ca_file = folder / "grpc-ca.crt"
    _write(ca_file, ca.ca_pem)
    out = {}
    for stem, identity in identities.items():
        issued = ca.issue(identity)
        files = CertFiles(folder / f"{stem}.crt", folder / f"{stem}.key", ca_file)
        _write(files.cert, issued.cert)
        _write(files.key, issued.key)
        out[stem] = files
    return out


def _subject(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])])


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
