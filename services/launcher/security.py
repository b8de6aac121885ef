"""`duet up`'s security wiring: API keys handed to the gateway in a private 0600 file (never
on a command line, which `ps` shows to every user), HTTPS for the gateway, and, unless
--insecure, a throwaway CA that issues every child a certificate naming its role and id
(mutual TLS on every gRPC link, each caller limited to the methods its role needs:
shared/security/) and a random password for the Redis duet up starts."""
from __future__ import annotations

import os
import secrets
import shutil
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.config import UpConfig
from services.launcher.throwaway_pki import CertFiles
from shared.security.identity import Identity


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


# inherited from duet up's environment, these would give a child other certificates than its own
_GRPC_TLS_VARS = ("DUET_GRPC_TLS_CERT_FILE", "DUET_GRPC_TLS_KEY_FILE", "DUET_GRPC_TLS_CA_FILE")


@dataclass(frozen=True)
class SecureStack:
    """What duet up made to close the stack: a certificate per child (name -> files: "router",
    "gateway", and each worker by its id), and the Redis password in two 0600 files, one for
    redis-server (its config file), one for the services. Empty: --insecure."""

    certs: dict[str, CertFiles] = field(default_factory=dict)
    redis_password_file: Path | None = None  # None with --redis-url: that Redis is secured by its owner
    redis_config_file: Path | None = None

    @property
    def mutual_tls(self) -> bool:
        return bool(self.certs)

    def grpc_args(self, child: str) -> list[str]:
        """The child's own certificate and the CA (paths only, no secrets)."""
        files = self.certs.get(child)
        if files is None:
            return []
        return ["--grpc-tls-cert-file", str(files.cert), "--grpc-tls-key-file", str(files.key),
                "--grpc-tls-ca-file", str(files.ca)]

    def child_env(self) -> dict[str, str]:
        """The services read the password from the file (never argv, never the variable)."""
        env = {var: "" for var in _GRPC_TLS_VARS}
        if self.redis_password_file is not None:
            env.update({"DUET_REDIS_PASSWORD_FILE": str(self.redis_password_file), "DUET_REDIS_PASSWORD": ""})
        return env


def make_secure(cfg: UpConfig, vault: SecretsDir, *, own_redis: bool) -> SecureStack:
    """A throwaway CA and a certificate for each child, and (for the Redis that duet up starts)
    a random password."""
    from services.launcher.throwaway_pki import make_certificates
    # a switchable worker's certificate names the role `worker`: it may advertise any worker role
    identities = {"router": Identity("router"), "gateway": Identity("gateway"),
                  **{name: Identity("worker" if cfg.switchable else role, name)
                     for i in range(max(1, len(cfg.models))) for role, name in cfg.worker_names(i)}}
    if cfg.switchable:
        identities["planner"] = Identity("planner")  # the only caller of the workers' SetRole
    certs = make_certificates(vault.folder(), identities)
    if not own_redis:
        return SecureStack(certs)
    password = secrets.token_urlsafe(32)
    return SecureStack(certs, vault.write("redis-password", password + "\n"),
                       vault.write("redis.conf", f"requirepass {password}\n"))
