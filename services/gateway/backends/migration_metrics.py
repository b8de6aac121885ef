"""The gateway's failover counters (migration.py), in the gateway's metrics registry."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from services.gateway.backends.migration import CAUSES, REBUILT_SOURCES, RebuiltTokens

GIVE_UP_REASONS = ("limit", "deadline")


@dataclass
class MigrationMetrics:
    registry: CollectorRegistry

    def __post_init__(self) -> None:
        r = self.registry
        self.migrations = Counter("duet_migrations", "Streams moved to another worker after theirs failed",
                                  ["cause"], registry=r)
        self.rebuilt_tokens = Counter("duet_migration_rebuilt_tokens",
                                      "Tokens of KV a moved stream's new decode worker got, by where they came from",
                                      ["source"], registry=r)
        self.given_up = Counter("duet_migrations_given_up", "Failed streams not moved (the client got the error)",
                                ["reason"], registry=r)
        for cause in CAUSES:  # every label from the start: a dashboard reads 0, not nothing
            self.migrations.labels(cause=cause)
        for source in REBUILT_SOURCES:
            self.rebuilt_tokens.labels(source=source)
        for reason in GIVE_UP_REASONS:
            self.given_up.labels(reason=reason)

    def rebuilt(self, tokens: RebuiltTokens) -> None:
        for source, count in tokens.by_source().items():
            self.rebuilt_tokens.labels(source=source).inc(count)
