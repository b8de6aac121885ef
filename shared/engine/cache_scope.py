"""Whose prompt a request's KV is: the prefix-cache namespace it may match and fill, and the
tenant its pages count against.

The gateway computes both as keyed hashes (services/gateway/http_edge/cache_namespace.py):
the namespace from the API key's tenant and the request's `cache_salt` (or an operator's
shared salt), the tenant from the API key alone. They are opaque numbers here. A request
only matches pages inserted under its own namespace (radix_cache.py), and the namespace
seeds the chained page hashes (shared/registry/prefix_hashes.py), so the registry publishes
salted hashes only. The tenant drives the KV quotas (tenant_quota.py). The offline engine
and tests use the default scope: namespace 0, tenant 0."""
from __future__ import annotations

from dataclasses import dataclass

UINT64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class CacheScope:
    namespace: int = 0  # uint64: the prefix cache a request may read and fill, and its hashes' seed
    tenant: int = 0  # uint64: whose KV quotas its pages count against

    def __post_init__(self) -> None:
        for name in ("namespace", "tenant"):
            value = getattr(self, name)
            if not 0 <= value <= UINT64_MAX:
                raise ValueError(f"cache scope {name} must be a uint64, got {value}")


DEFAULT_SCOPE = CacheScope()
