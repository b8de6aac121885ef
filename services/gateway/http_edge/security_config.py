"""The gateway's security settings: API keys, HTTPS, /metrics on its own port, and how it
reaches the router, workers (gRPC TLS) and Redis (password, TLS). CLI flags with DUET_*
environment defaults, like GatewayConfig, which nests one of these."""
from __future__ import annotations

from dataclasses import dataclass

from shared.registry.connection import RedisConnection
from shared.security.grpc_tls import GrpcTlsConfig
from shared.settings import parsers
from shared.settings.spec import nested, setting


@dataclass
class SecurityConfig:
    # API keys clients must send as `Authorization: Bearer KEY` on every route but /health,
    # /live and /metrics; none configured = no authentication (the laptop default). The
    # variable's keys and the flags' are all accepted.
    api_keys: list[str] = setting(
        flag="--api-key", env="DUET_API_KEYS", repeat=True, secret=True,
        help="an API key clients must send (Authorization: Bearer KEY); repeatable. Visible in `ps`: "
             "prefer env DUET_API_KEYS (comma-separated) or --api-keys-file")
    api_keys_file: str | None = setting(
        flag="--api-keys-file", env="DUET_API_KEYS_FILE",
        help="file with one API key per line, e.g. a mounted Secret; re-read when it changes")
    tls_cert_file: str | None = setting(flag="--tls-cert-file", env="DUET_TLS_CERT_FILE",
                                        help="serve HTTPS with this PEM certificate chain")
    tls_key_file: str | None = setting(flag="--tls-key-file", env="DUET_TLS_KEY_FILE",
                                       help="the certificate's PEM private key")
    tls_client_ca_file: str | None = setting(flag="--tls-client-ca-file", env="DUET_TLS_CLIENT_CA_FILE",
                                             help="HTTPS clients must present a certificate signed by this CA")
    # prefix-cache isolation (cache_namespace.py)
    cache_namespace_key_file: str | None = setting(
        flag="--cache-namespace-key-file", env="DUET_CACHE_NAMESPACE_KEY_FILE",
        help="file with the secret (at least 16 characters) that keys each tenant's prefix-cache namespace; every "
             "gateway replica must read the same one (unset: a random key per gateway process, so replicas share no "
             "cached prefixes)")
    shared_cache_salts: list[str] = setting(
        (), flag="--shared-cache-salts", env="DUET_SHARED_CACHE_SALTS", parse=parsers.words,
        help="cache_salt values whose prompts every tenant shares (e.g. a common system prompt), comma-separated; "
             "any other salt, or none, keeps a tenant's prefix cache its own")
    metrics_port: int = setting(0, flag="--metrics-port", env="DUET_METRICS_PORT",
                                help="serve /metrics on this port only (plain HTTP, for Prometheus behind a "
                                     "NetworkPolicy); 0 = on the API port")
    grpc_tls: GrpcTlsConfig = nested(GrpcTlsConfig, "gRPC TLS (between gateway, router and workers)")
    redis: RedisConnection = nested(RedisConnection, "Redis authentication and TLS")

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file (HTTPS)")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")

    @property
    def https(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_file)

    def uvicorn_ssl_kwargs(self) -> dict:
        """uvicorn.run(...) options for HTTPS (empty: plain HTTP)."""
        if not self.https:
            return {}
        import ssl

        from shared.security.secret_files import read_pem
        read_pem(self.tls_cert_file, "HTTPS certificate")  # clear errors before uvicorn's
        read_pem(self.tls_key_file, "HTTPS key")
        kwargs = {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file}
        if self.tls_client_ca_file:
            read_pem(self.tls_client_ca_file, "HTTPS client CA")
            kwargs.update(ssl_ca_certs=self.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return kwargs
