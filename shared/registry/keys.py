"""Redis key and channel names of the registry (one place, so every reader agrees).

  <p>:worker:<id>         hash   WorkerInfo fields + load; TTL renewed by heartbeat
  <p>:worker:<id>:nixl    hash   rank -> NIXL agent metadata bytes; same TTL
  <p>:worker:<id>:pages   set    page hashes (decimal) the worker's prefix cache holds (any tier); same TTL
  <p>:worker:<id>:pages:host  set  of those, the ones held in its host tier only; same TTL
  <p>:workers:events      pubsub JSON {"event": "join"|"leave", "worker_id", "instance_nonce"}
  <p>:model:<m>:lora      hash   LoRA adapter name -> folder, loaded at run time for served model <m>
  <p>:model:<m>:lora:kept string set with every write of that record: missing, Redis lost it

Who writes and reads each, and the KV events: docs/ARCHITECTURE.md, "Registry keys and KV events".
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryKeys:
    prefix: str = "duet"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def nixl(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}:nixl"

    def pages(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}:pages"

    def host_pages(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}:pages:host"

    def lora_adapters(self, model: str) -> str:
        """The adapters the gateway loaded at run time for `model` (no TTL: a worker that starts
        later loads them too; unloading removes them)."""
        return f"{self.prefix}:model:{model}:lora"

    def lora_kept(self, model: str) -> str:
        """Set with every write of `model`'s adapter record and never removed: a record missing
        with it is empty (nothing loaded at run time, or all unloaded); missing without it, Redis
        lost it (restarted empty), and a gateway writes it back (grpc_adapters.py)."""
        return f"{self.prefix}:model:{model}:lora:kept"

    @property
    def events_channel(self) -> str:
        return f"{self.prefix}:workers:events"

    @property
    def worker_scan_pattern(self) -> str:
        return f"{self.prefix}:worker:*"

    def worker_id_from_key(self, key: str) -> str | None:
        """The id of a main worker key; None for sub-keys (:nixl, :pages) and foreign keys."""
        head = f"{self.prefix}:worker:"
        if not key.startswith(head):
            return None
        rest = key[len(head):]
        return rest if rest and ":" not in rest else None
