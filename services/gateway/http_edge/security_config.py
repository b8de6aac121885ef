"""The gateway's security settings: API keys, HTTPS, /metrics on its own port, and how it
reaches the router, workers (gRPC TLS) and Redis (password, TLS). CLI flags with DUET_*
environment defaults, like GatewayConfig, which holds one of these."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.registry.connection import RedisConnection
from shared.security.grpc_tls import GrpcTlsConfig


@dataclass
class SecurityConfig:
    # API keys clients must send as `Authorization: Bearer KEY` on every route but /health,
    # /live and /metrics; none configured = no authentication (the laptop default).
    api_keys: list[str] = field(default_factory=list, repr=False)  # --api-key / DUET_API_KEYS
    api_keys_file: str | None = None   # one key per line (a mounted Secret); re-read when it changes
    tls_cert_file: str | None = None   # HTTPS: certificate chain (PEM)
    tls_key_file: str | None = None    # HTTPS: its private key
    tls_client_ca_file: str | None = None  # HTTPS: require client certificates signed by this CA
    metrics_port: int = 0              # 0: /metrics on the API port; else only there (plain HTTP)
    grpc_tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)
    redis: RedisConnection = field(default_factory=RedisConnection)

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

    @staticmethod
    def add_args(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        g = parser.add_argument_group("security")
        g.add_argument("--api-key", action="append", default=None,
                       help="an API key clients must send (Authorization: Bearer KEY); repeatable. "
                            "Visible in `ps`: prefer env DUET_API_KEYS (comma-separated) or --api-keys-file")
        g.add_argument("--api-keys-file", default=env.get("DUET_API_KEYS_FILE") or None,
                       help="file with one API key per line, e.g. a mounted Secret; re-read when it "
                            "changes (env DUET_API_KEYS_FILE)")
        g.add_argument("--tls-cert-file", default=env.get("DUET_TLS_CERT_FILE") or None,
                       help="serve HTTPS with this PEM certificate chain (env DUET_TLS_CERT_FILE)")
        g.add_argument("--tls-key-file", default=env.get("DUET_TLS_KEY_FILE") or None,
                       help="the certificate's PEM private key (env DUET_TLS_KEY_FILE)")
        g.add_argument("--tls-client-ca-file", default=env.get("DUET_TLS_CLIENT_CA_FILE") or None,
                       help="HTTPS clients must present a certificate signed by this CA "
                            "(env DUET_TLS_CLIENT_CA_FILE)")
        g.add_argument("--metrics-port", type=int, default=int(env.get("DUET_METRICS_PORT") or 0),
                       help="serve /metrics on this port only (plain HTTP, for Prometheus behind a "
                            "NetworkPolicy); 0 = on the API port (env DUET_METRICS_PORT)")
        parser.set_defaults(api_keys_env=env.get("DUET_API_KEYS") or "")
        GrpcTlsConfig.add_args(parser, env)
        RedisConnection.add_args(parser, env)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SecurityConfig":
        keys = [k for k in args.api_keys_env.replace(",", " ").split()] + list(args.api_key or [])
        return cls(api_keys=keys, api_keys_file=args.api_keys_file, tls_cert_file=args.tls_cert_file,
                   tls_key_file=args.tls_key_file, tls_client_ca_file=args.tls_client_ca_file,
                   metrics_port=args.metrics_port, grpc_tls=GrpcTlsConfig.from_args(args),
                   redis=RedisConnection.from_args(args))
