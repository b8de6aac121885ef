"""Registry settings, from CLI flags and DUET_* environment variables."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.registry.connection import RedisConnection

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class RegistryConfig:
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "duet"               # key namespace; lets tests or deployments share a Redis
    ttl_s: float = 6.0                 # a worker that misses heartbeats for this long is gone
    heartbeat_interval_s: float = 1.0  # keep well under ttl_s (>= 3 beats per TTL)
    scan_interval_s: float = 1.0       # watcher's full re-scan period (leaves show up here)
    socket_timeout_s: float = 2.0      # bounds every Redis call, so an outage never hangs a loop
    connection: RedisConnection = field(default_factory=RedisConnection)  # password, TLS

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s * 2 > self.ttl_s:
            raise ValueError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be at most half of ttl_s={self.ttl_s}"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
        """Add --redis-url (default from DUET_REDIS_URL) and the registry timing flags."""
        env = os.environ if env is None else env
        parser.add_argument("--redis-url", default=env.get("DUET_REDIS_URL", DEFAULT_REDIS_URL),
                            help="Redis registry URL (env DUET_REDIS_URL)")
        parser.add_argument("--registry-ttl", type=float,
                            default=float(env.get("DUET_REGISTRY_TTL", RegistryConfig.ttl_s)),
                            help="seconds a worker entry lives without heartbeat (env DUET_REGISTRY_TTL)")
        parser.add_argument("--registry-heartbeat", type=float,
                            default=float(env.get("DUET_REGISTRY_HEARTBEAT", RegistryConfig.heartbeat_interval_s)),
                            help="heartbeat period in seconds (env DUET_REGISTRY_HEARTBEAT)")
        parser.add_argument("--registry-prefix", default=env.get("DUET_REGISTRY_PREFIX", RegistryConfig.prefix),
                            help="Redis key namespace (env DUET_REGISTRY_PREFIX)")
        RedisConnection.add_args(parser, env)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RegistryConfig":
        return cls(redis_url=args.redis_url, prefix=args.registry_prefix, ttl_s=args.registry_ttl,
                   heartbeat_interval_s=args.registry_heartbeat, connection=RedisConnection.from_args(args))

    def client_kwargs(self) -> dict:
        """Keyword arguments for redis.Redis.from_url(self.redis_url, ...): timeouts, password, TLS."""
        return {"socket_timeout": self.socket_timeout_s, "socket_connect_timeout": self.socket_timeout_s,
                **self.connection.client_kwargs(self.redis_url)}
