"""Certificates for TLS tests, made with `cryptography`: a CA, a server certificate for
127.0.0.1 / localhost (and any extra DNS names), client certificates, certificates naming a
Duet identity (shared/security/identity.py) or none, a second CA that signed none of them.
Written as PEM files with cert-manager's names (tls.crt, tls.key, ca.crt)."""
from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class CertFiles:
    cert: Path
    key: Path
    ca: Path  # the CA that signed this certificate

    @property
    def folder(self) -> Path:
        return self.cert.parent


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCA:
    """A self-signed CA that issues server and client certificates into `root`."""

    __test__ = False  # not a pytest class

    def __init__(self, root: Path, name: str = "duet-test-ca"):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_file = self.root / f"{name}.crt"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue_identity(self, folder: str, identity) -> CertFiles:
        """A certificate naming a Duet identity, as duet up's CA issues them."""
        return self.issue(folder, identity.uri, dns=tuple(identity.dns_names), ips=(), uris=(identity.uri,))

    def issue(self, folder: str, cn: str, *, server: bool = True, client: bool = True,
              dns: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",),
              uris: tuple[str, ...] = ()) -> CertFiles:
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        san = ([x509.UniformResourceIdentifier(u) for u in uris] + [x509.DNSName(d) for d in dns]
               + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips])
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        out = self.root / folder
        out.mkdir(parents=True, exist_ok=True)
        (out / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / "tls.key").write_bytes(_pem_key(key))
        (out / "tls.key").chmod(0o600)
        (out / "ca.crt").write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return CertFiles(out / "tls.crt", out / "tls.key", out / "ca.crt")
