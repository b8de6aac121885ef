"""duet.proto's cache_namespace, tenant and lora_adapter fields (ReserveRequest, PrefillRequest,
GenerateRequest) <-> the engine's CacheScope."""
from __future__ import annotations

from shared.engine.cache_scope import CacheScope


def cache_scope_from_proto(request) -> CacheScope:
    """The prefix-cache namespace, tenant and LoRA adapter a Reserve, Prefill or Generate request carries."""
    return CacheScope(namespace=request.cache_namespace, tenant=request.tenant, adapter=request.lora_adapter)


def cache_scope_fields(scope: CacheScope) -> dict[str, int | str]:
    """The fields to set on a Reserve, Prefill or Generate request for scope."""
    return {"cache_namespace": scope.namespace, "tenant": scope.tenant, "lora_adapter": scope.adapter}
