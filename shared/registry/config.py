"""Registry settings, from CLI flags and DUET_* environment variables (shared/settings)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.registry.connection import RedisConnection
from shared.settings.spec import nested, setting

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class RegistryConfig:
    redis_url: str = setting(DEFAULT_REDIS_URL, flag="--redis-url", env="DUET_REDIS_URL", help="Redis registry URL")
    prefix: str = setting("duet", flag="--registry-prefix", env="DUET_REGISTRY_PREFIX",
                          help="Redis key namespace; lets tests or deployments share a Redis")
    ttl_s: float = setting(6.0, flag="--registry-ttl", env="DUET_REGISTRY_TTL",
                           help="seconds a worker entry lives without heartbeat")
    heartbeat_interval_s: float = setting(1.0, flag="--registry-heartbeat", env="DUET_REGISTRY_HEARTBEAT",
                                          help="heartbeat period in seconds (at most half the TTL)")
    # routers pair a conversation's next turn with the worker that holds it: a page a worker
    # just cached must not wait a whole heartbeat to be seen
    kv_events_interval_s: float = setting(
        0.05, flag="--registry-kv-events-interval", env="DUET_REGISTRY_KV_EVENTS_INTERVAL",
        help="seconds between publications of prefix-cache changes (page hashes) between heartbeats")
    scan_interval_s: float = 1.0       # watcher's full re-scan period (leaves show up here)
    socket_timeout_s: float = 2.0      # bounds every Redis call, so an outage never hangs a loop
    connection: RedisConnection = nested(RedisConnection, "Redis authentication and TLS")

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s * 2 > self.ttl_s:
            raise ValueError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be at most half of ttl_s={self.ttl_s}"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def client_kwargs(self) -> dict:
        """Keyword arguments for redis.Redis.from_url(self.redis_url, ...): timeouts, password, TLS."""
        return {"socket_timeout": self.socket_timeout_s, "socket_connect_timeout": self.socket_timeout_s,
                **self.connection.client_kwargs(self.redis_url)}
