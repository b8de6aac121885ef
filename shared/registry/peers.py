"""Read what a KV-transfer peer needs about another worker: its entry and NIXL metadata.

Both reads happen in one MULTI, so the metadata belongs to the instance (nonce)
returned with it. Sync variant for TP-rank processes that have no event loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis

from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.worker_info import WorkerInfo


@dataclass
class PeerRecord:
    info: WorkerInfo
    nixl_metadata: dict[int, bytes]  # rank -> metadata for nixl add_remote_agent

    @property
    def instance_nonce(self) -> str:
        return self.info.instance_nonce


class PeerNotFound(LookupError):
    """The worker is not (or no longer) in the registry."""


def _decode(worker_id: str, raw_info: dict, raw_nixl: dict) -> PeerRecord:
    if not raw_info:
        raise PeerNotFound(f"worker {worker_id} is not in the registry")
    info = WorkerInfo.from_hash(raw_info)
    metadata = {int(k.decode() if isinstance(k, bytes) else k): bytes(v) for k, v in raw_nixl.items()}
    return PeerRecord(info=info, nixl_metadata=metadata)


# A pooled connection to a Redis that restarted fails once (the server closed it); the
# transaction is not retried by redis-py, so one fresh attempt is made here.
_ATTEMPTS = 2


async def fetch_peer(client, keys: RegistryKeys, worker_id: str) -> PeerRecord:
    """async redis client variant."""
    for attempt in range(_ATTEMPTS):
        pipe = client.pipeline(transaction=True)
        pipe.hgetall(keys.worker(worker_id))
        pipe.hgetall(keys.nixl(worker_id))
        try:
            raw_info, raw_nixl = await pipe.execute()
            break
        except redis.ConnectionError:
            if attempt + 1 == _ATTEMPTS:
                raise
    return _decode(worker_id, raw_info, raw_nixl)


def fetch_peer_sync(client: redis.Redis, keys: RegistryKeys, worker_id: str) -> PeerRecord:
    """sync redis client variant."""
    for attempt in range(_ATTEMPTS):
        pipe = client.pipeline(transaction=True)
        pipe.hgetall(keys.worker(worker_id))
        pipe.hgetall(keys.nixl(worker_id))
        try:
            raw_info, raw_nixl = pipe.execute()
            break
        except redis.ConnectionError:
            if attempt + 1 == _ATTEMPTS:
                raise
    return _decode(worker_id, raw_info, raw_nixl)


def connect_sync(config: RegistryConfig) -> redis.Redis:
    """A sync Redis client with bounded socket timeouts."""
    return redis.Redis.from_url(config.redis_url, **config.client_kwargs())
