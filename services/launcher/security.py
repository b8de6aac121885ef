"""`duet up`'s security wiring: API keys handed to the gateway in a private 0600 file (never
on a command line, which `ps` shows to every user), HTTPS for the gateway, and one gRPC
certificate (+ CA for mutual TLS) for every service."""
from __future__ import annotations

import os
import shutil
import ssl
import tempfile
from pathlib import Path

from services.launcher.config import UpConfig


class SecretsDir:
    """A 0700 temp folder for files only this user may read; removed by close()."""

    def __init__(self):
        self.path: Path | None = None

    def write(self, name: str, text: str) -> Path:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="duet-up-secrets-"))  # mode 0700
        target = self.path / name
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return target

    def close(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def grpc_tls_args(cfg: UpConfig) -> list[str]:
    """The same gRPC TLS flags for router, workers and gateway (paths only, no secrets)."""
    args = []
    for flag, value in (("--grpc-tls-cert-file", cfg.grpc_tls_cert_file), ("--grpc-tls-key-file", cfg.grpc_tls_key_file),
                        ("--grpc-tls-ca-file", cfg.grpc_tls_ca_file)):
        if value:
            args += [flag, str(Path(value).resolve())]
    return args


def gateway_security(cfg: UpConfig, secrets: SecretsDir) -> tuple[list[str], dict[str, str]]:
    """Extra gateway flags and environment: HTTPS files, and the API keys as a 0600 file."""
    args: list[str] = []
    if cfg.tls_cert_file:
        args += ["--tls-cert-file", str(Path(cfg.tls_cert_file).resolve()),
                 "--tls-key-file", str(Path(cfg.tls_key_file).resolve())]
    env = {"DUET_API_KEYS": ""}  # the file below carries them; keep the variable from being inherited
    if cfg.api_keys:
        keys = secrets.write("api-keys", "".join(k + "\n" for k in cfg.api_keys))
        if cfg.api_keys_file:  # both given: one file with every key
            extra = Path(cfg.api_keys_file).read_text()
            keys.write_text(keys.read_text() + extra)
        env["DUET_API_KEYS_FILE"] = str(keys)
    elif cfg.api_keys_file:
        env["DUET_API_KEYS_FILE"] = str(Path(cfg.api_keys_file).resolve())
    else:
        env["DUET_API_KEYS_FILE"] = ""
    return args, env


def health_ssl_context(cfg: UpConfig) -> ssl.SSLContext | None:
    """For duet up's own /health probe of its gateway child on this host: the probe sends
    nothing secret, and the certificate may be for a name other than --host."""
    if not cfg.tls_cert_file:
        return None
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
