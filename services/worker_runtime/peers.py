"""NIXL peers of this worker, looked up by registry id (never by an address from a request).

Metadata is fetched from Redis once per (worker id, instance nonce) and cached by the
agent; a changed nonce (restart at the same id) replaces the cached metadata."""
from __future__ import annotations

from shared.kv_transfer.agent import KvTransferAgent, Peer
from shared.kv_transfer.pool_info import PoolInfo
from shared.kv_transfer.rank_transfers import PeerSpec
from shared.registry.keys import RegistryKeys
from shared.registry.peers import PeerNotFound, fetch_peer


class PeerResolver:
    def __init__(self, agent: KvTransferAgent, redis_client, keys: RegistryKeys, rank: int = 0):
        self.agent = agent
        self.redis = redis_client
        self.keys = keys
        self.rank = rank
        self._records: dict[str, object] = {}  # worker id -> PeerRecord (all ranks' metadata)

    async def get(self, worker_id: str, instance_nonce: str, compat_hash: str) -> Peer:
        cached = self.agent.peer(worker_id)
        if cached is not None and cached.instance_nonce == instance_nonce:
            return cached
        record = await fetch_peer(self.redis, self.keys, worker_id)
        if instance_nonce and record.instance_nonce != instance_nonce:
            raise PeerNotFound(f"worker {worker_id} restarted since the reservation was made")
        if compat_hash and record.info.compat_hash != compat_hash:
            raise PeerNotFound(f"worker {worker_id} serves an incompatible KV layout")
        if self.rank not in record.nixl_metadata:
            raise PeerNotFound(f"worker {worker_id} published no NIXL metadata for rank {self.rank}")
        pool = PoolInfo.from_record(record.info.pool(self.rank))
        self._records[worker_id] = record
        return self.agent.add_peer(worker_id, record.instance_nonce, record.nixl_metadata[self.rank], pool)

    async def capability_key(self, worker_id: str, instance_nonce: str) -> str:
        """The public key (hex) that verifies the write capabilities of worker_id's instance
        instance_nonce, from its registry entry (read once per instance)."""
        record = self._records.get(worker_id)
        if record is None or record.instance_nonce != instance_nonce:
            record = await fetch_peer(self.redis, self.keys, worker_id)
            if record.instance_nonce != instance_nonce:
                raise PeerNotFound(f"worker {worker_id} restarted since the reservation was made")
            self._records[worker_id] = record
        return record.info.capability_key

    def rank_specs(self, peer: Peer, tp: int) -> list[PeerSpec]:
        """Every rank of an already resolved peer (get() first), for tensor-parallel followers."""
        record = self._records.get(peer.worker_id)
        if record is None or record.instance_nonce != peer.instance_nonce:
            raise PeerNotFound(f"worker {peer.worker_id}: no registry record for its current instance")
        missing = [r for r in range(tp) if r not in record.nixl_metadata]
        if missing:
            raise PeerNotFound(f"worker {peer.worker_id} published no NIXL metadata for ranks {missing}")
        return [PeerSpec(peer.worker_id, record.instance_nonce, r, record.nixl_metadata[r],
                         PoolInfo.from_record(record.info.pool(r))) for r in range(tp)]

    def add(self, spec: PeerSpec) -> Peer:
        """This rank's agent's peer for one remote rank (cached per worker instance and rank)."""
        return self.agent.add_peer(spec.worker_id, spec.instance_nonce, spec.metadata, spec.pool, rank=spec.rank)

    def forget(self, worker_id: str) -> None:
        self.agent.remove_peer(worker_id)
