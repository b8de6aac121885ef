"""How to reach Redis securely: a password kept off command lines, and TLS (rediss://).

The password comes from DUET_REDIS_PASSWORD or a mounted file (DUET_REDIS_PASSWORD_FILE),
or inside the URL (redis://:PASSWORD@host, as the manifests build it from a Secret);
an explicit one wins over the URL's. TLS: a `rediss://` URL, verified against
DUET_REDIS_TLS_CA_FILE (else the system roots), with a client certificate when Redis
asks for one (DUET_REDIS_TLS_CERT_FILE / DUET_REDIS_TLS_KEY_FILE)."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.security.secret_files import read_secret_file


@dataclass(frozen=True)
class RedisConnection:
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--redis-tls-cert-file and --redis-tls-key-file go together")

    def client_kwargs(self, url: str) -> dict:
        """Extra keyword arguments for redis.Redis.from_url(url, ...)."""
        kwargs: dict = {}
        if self.password:
            kwargs["password"] = self.password
        if url.startswith("rediss://"):
            kwargs["ssl_cert_reqs"] = "required"
            if self.tls_ca_file:
                kwargs["ssl_ca_certs"] = self.tls_ca_file
            if self.tls_cert_file:
                kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = self.tls_cert_file, self.tls_key_file
        elif self.tls_ca_file or self.tls_cert_file:
            raise ValueError(f"Redis TLS files are set but the URL is not rediss:// ({url.split('://')[0]}://)")
        return kwargs

    @staticmethod
    def add_args(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        g = parser.add_argument_group("Redis authentication and TLS")
        g.add_argument("--redis-password-file", default=env.get("DUET_REDIS_PASSWORD_FILE") or None,
                       help="file holding the Redis password (env DUET_REDIS_PASSWORD_FILE; or the "
                            "password itself in env DUET_REDIS_PASSWORD; never a flag: argv is public)")
        g.add_argument("--redis-tls-ca-file", default=env.get("DUET_REDIS_TLS_CA_FILE") or None,
                       help="CA bundle verifying a rediss:// server (env DUET_REDIS_TLS_CA_FILE)")
        g.add_argument("--redis-tls-cert-file", default=env.get("DUET_REDIS_TLS_CERT_FILE") or None,
                       help="client certificate for Redis TLS (env DUET_REDIS_TLS_CERT_FILE)")
        g.add_argument("--redis-tls-key-file", default=env.get("DUET_REDIS_TLS_KEY_FILE") or None,
                       help="its key (env DUET_REDIS_TLS_KEY_FILE)")
        parser.set_defaults(redis_password_env=env.get("DUET_REDIS_PASSWORD") or None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RedisConnection":
        password = getattr(args, "redis_password_env", None)
        if args.redis_password_file:
            password = read_secret_file(args.redis_password_file, "Redis password")
        return cls(password=password, tls_ca_file=args.redis_tls_ca_file,
                   tls_cert_file=args.redis_tls_cert_file, tls_key_file=args.redis_tls_key_file)
