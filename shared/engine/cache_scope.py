"""Whose prompt a request's KV is: the prefix-cache namespace it may match and fill, the tenant
its pages count against, and the LoRA adapter that computes it.

The gateway computes namespace and tenant as keyed hashes (services/gateway/http_edge/cache_namespace.py):
the namespace from the API key's tenant and the request's `cache_salt` (or an operator's
shared salt), the tenant from the API key alone. They are opaque numbers here. The adapter is
the name of the LoRA adapter the request runs with ("" for the base model): its KV differs from
the base model's for the same tokens, so it is part of the request's identity. `cache_key`
mixes it into the namespace; a request only matches pages inserted under its own key
(radix_cache.py), and the key seeds the chained page hashes (shared/registry/prefix_hashes.py),
so the registry publishes salted hashes only and the base model and each adapter never share a
page. The tenant drives the KV quotas (tenant_quota.py). The offline engine and tests use the
default scope: namespace 0, tenant 0, the base model."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

UINT64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class CacheScope:
    namespace: int = 0  # uint64: the prefix cache a request may read and fill
    tenant: int = 0  # uint64: whose KV quotas its pages count against
    adapter: str = ""  # the LoRA adapter's name, "" for the base model

    def __post_init__(self) -> None:
        for name in ("namespace", "tenant"):
            value = getattr(self, name)
            if not 0 <= value <= UINT64_MAX:
                raise ValueError(f"cache scope {name} must be a uint64, got {value}")

    @property
    def cache_key(self) -> int:
        """uint64: the prefix-cache partition this request reads and fills, and the seed of its
        page hashes: the namespace itself for the base model, mixed with the adapter's name else."""
        if not self.adapter:
            return self.namespace
        digest = hashlib.blake2b(self.namespace.to_bytes(8, "little"), digest_size=8, person=b"duet-lora")
        digest.update(self.adapter.encode())
        return int.from_bytes(digest.digest(), "little")


DEFAULT_SCOPE = CacheScope()
