"""How to reach Redis securely: a password kept off command lines, and TLS (rediss://).

The password comes from DUET_REDIS_PASSWORD or a mounted file (DUET_REDIS_PASSWORD_FILE),
or inside the URL (redis://:PASSWORD@host, as the manifests build it from a Secret);
an explicit one wins over the URL's. TLS: a `rediss://` URL, verified against
DUET_REDIS_TLS_CA_FILE (else the system roots), with a client certificate when Redis
asks for one (DUET_REDIS_TLS_CERT_FILE / DUET_REDIS_TLS_KEY_FILE)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.security.secret_files import read_secret_file
from shared.settings.spec import setting


@dataclass(frozen=True)
class RedisConnection:
    # the password itself only from the environment: a command line is visible in `ps`
    password: str | None = setting(env="DUET_REDIS_PASSWORD", secret=True,
                                   help="the Redis password (or inside the URL, or in --redis-password-file)")
    password_file: str | None = setting(
        flag="--redis-password-file", env="DUET_REDIS_PASSWORD_FILE",
        help="file holding the Redis password (a mounted Secret); wins over DUET_REDIS_PASSWORD")
    tls_ca_file: str | None = setting(flag="--redis-tls-ca-file", env="DUET_REDIS_TLS_CA_FILE",
                                      help="CA bundle verifying a rediss:// server")
    tls_cert_file: str | None = setting(flag="--redis-tls-cert-file", env="DUET_REDIS_TLS_CERT_FILE",
                                        help="client certificate for Redis TLS")
    tls_key_file: str | None = setting(flag="--redis-tls-key-file", env="DUET_REDIS_TLS_KEY_FILE", help="its key")

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--redis-tls-cert-file and --redis-tls-key-file go together")
        if self.password_file:  # read once, at start: a bad path fails the process now
            object.__setattr__(self, "password", read_secret_file(self.password_file, "Redis password"))

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
