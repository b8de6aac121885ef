"""duet.proto's cache_namespace and tenant fields (ReserveRequest, PrefillRequest,
GenerateRequest) <-> the engine's CacheScope."""
from __future__ import annotations

from shared.engine.cache_scope import CacheScope


def cache_scope_from_proto(request) -> CacheScope:
    """The prefix-cache namespace and tenant a Reserve, Prefill or Generate request carries."""
    return CacheScope(namespace=request.cache_namespace, tenant=request.tenant)


def cache_scope_fields(scope: CacheScope) -> dict[str, int]:
    """The fields to set on a Reserve, Prefill or Generate request for scope."""
    return {"cache_namespace": scope.namespace, "tenant": scope.tenant}
