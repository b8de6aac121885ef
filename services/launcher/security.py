"""`duet up`'s security wiring: API keys handed to the gateway in a private 0600 file (never
on a command line, which `ps` shows to every user), HTTPS for the gateway, one gRPC
certificate (+ CA for mutual TLS) for every service, and `--secure`: a throwaway CA and
certificate (mTLS on every gRPC link) and a random password for the Redis duet up starts."""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.launcher.config import UpConfig


class SecretsDir:
    """A 0700 temp folder for files only this user may read; removed by close()."""

    def __init__(self):
        self.path: Path | None = None

    def folder(self) -> Path:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="duet-up-secrets-"))  # mode 0700
        return self.path

    def write(self, name: str, text: str) -> Path:
        target = self.folder() / name
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
    """Extra gateway flags and environment: HTTPS files, the API keys as a 0600 file, and a
    random key for the prefix-cache namespaces (0600 too)."""
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
    env["DUET_CACHE_NAMESPACE_KEY_FILE"] = str(secrets.write("cache-namespace-key", os.urandom(32).hex()))
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


@dataclass(frozen=True)
class SecureStack:
    """What `--secure` made: the gRPC files are in the returned config; the Redis password is
    in two 0600 files, one for redis-server (its config file), one for the services."""

    redis_password_file: Path | None  # None with --redis-url: that Redis is secured by its owner
    redis_config_file: Path | None

    def child_env(self) -> dict[str, str]:
        """The services read the password from the file (never argv, never the variable)."""
        if self.redis_password_file is None:
            return {}
        return {"DUET_REDIS_PASSWORD_FILE": str(self.redis_password_file), "DUET_REDIS_PASSWORD": ""}


def make_secure(cfg: UpConfig, vault: SecretsDir, *, own_redis: bool) -> tuple[UpConfig, SecureStack]:
    """A throwaway CA + certificate for mutual TLS on every gRPC link, and (for the Redis that
    duet up starts) a random password; the config returned names the certificate files."""
    from services.launcher.throwaway_pki import make_certificates
    certs = make_certificates(vault.folder(), [cfg.host])
    cfg = dataclasses.replace(cfg, grpc_tls_cert_file=str(certs.cert), grpc_tls_key_file=str(certs.key),
                              grpc_tls_ca_file=str(certs.ca))
    if not own_redis:
        return cfg, SecureStack(None, None)
    password = secrets.token_urlsafe(32)
    return cfg, SecureStack(vault.write("redis-password", password + "\n"),
                            vault.write("redis.conf", f"requirepass {password}\n"))
