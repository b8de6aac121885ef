"""Which adapters an engine serves, which it keeps in host memory, and which sit in its device slots.

Known adapters (name -> folder) come from `--lora` at start and from load() at run time (the
worker's LoadLoraAdapter RPC); each is read and checked when it is loaded, so a bad folder is
refused then, not at its first request. The host keeps the last `host_slots` adapters used
(least recently used out; one evicted is read from its folder again when needed). A request or
a decode reservation pins a device slot from admission to its end (acquire/release, by owner);
a slot nobody pins may be rewritten with another adapter, least recently used first, and when
every slot is pinned by other adapters the request waits, as it would for KV pages. Everything
runs on the engine's thread; with tensor parallelism rank 0 decides and each follower writes the
same slot of its shard (`mirror`)."""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..model_config import ModelConfig
from .adapter_files import LoraAdapter, LoraAdapterError, read_adapter
from .config import LoraConfig, check_adapter_name
from .layer import LoraStep, attach_lora
from .targets import LINEAR_PARTS

log = logging.getLogger("duet.engine.lora")


class UnknownAdapterError(LoraAdapterError):
    """A request names an adapter this engine does not serve."""


@dataclass
class Slot:
    name: str | None = None  # the adapter it holds; None: free, or unloaded while still pinned
    owners: set = field(default_factory=set)  # requests and reservations running with it
    last_used: int = 0


class LoraManager:
    def __init__(self, model, cfg: ModelConfig, config: LoraConfig, dtype: torch.dtype, device: torch.device,
                 triton: bool, max_rows: int):
        self.cfg = cfg
        self.max_rank = config.max_lora_rank
        self.host_slots = config.host_slots
        self.device = device
        self.step = LoraStep(row_slots=torch.full((max_rows,), -1, dtype=torch.int32, device=device),
                             scales=torch.zeros(config.slots, dtype=torch.float32, device=device), triton=triton)
        self.hooks = attach_lora(model, cfg, self.step, config.slots, config.max_lora_rank, dtype, device)
        self.known: dict[str, str] = {}  # name -> folder
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.slots = [Slot() for _ in range(config.slots)]
        self.owner_slot: dict[Hashable, int] = {}
        self._clock = 0
        # TP rank 0: callable(name, folder, slot) that writes the slot on every follower
        self.mirror: Callable[[str, str, int], None] | None = None
        for name, path in config.named().items():  # --lora: served from the start
            self.load(name, path)
        self.started = set(self.known)  # of the adapters known, those given at start (not run-time ones)

    @property
    def device_bytes(self) -> int:
        return sum(h.nbytes for h in self.hooks.values())

    # -- which adapters exist ------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoraAdapter:
        """Serve adapter `name` from folder `path` (read and checked now: LoraAdapterError)."""
        check_adapter_name(name)
        if name in self.known:
            raise LoraAdapterError(f"LoRA adapter {name!r} is loaded already (from {self.known[name]}); unload it "
                                   "first")
        adapter = read_adapter(name, path, self.cfg, self.max_rank)
        self.known[name] = adapter.path
        self._keep(adapter)
        log.info("LoRA adapter %s loaded from %s: rank %d, scale %g, %s", name, adapter.path, adapter.rank,
                 adapter.scale, ", ".join(adapter.modules))
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving `name` (False: not known). Requests running with it finish with it; its
        slot is free once they are done."""
        if self.known.pop(name, None) is None:
            return False
        self.started.discard(name)  # loaded again, it is a run-time adapter
        self.host.pop(name, None)
        for slot in self.slots:
            if slot.name == name:
                slot.name = None
        return True

    def knows(self, name: str) -> bool:
        return name in self.known

    @property
    def names(self) -> list[str]:
        return sorted(self.known)

    @property
    def runtime(self) -> dict[str, str]:
        """Adapters loaded since the start (name -> folder): what the gateway's run-time record
        holds, which the worker publishes so that a gateway started again can write it back."""
        return {name: path for name, path in sorted(self.known.items()) if name not in self.started}

    @property
    def resident(self) -> list[str]:
        """Adapters in a device slot now."""
        return sorted(s.name for s in self.slots if s.name is not None)

    # -- who runs with which slot ------------------------------------------------------------------
    def acquire(self, name: str, owner: Hashable) -> int | None:
        """Pin a device slot holding `name` for `owner` (its slot if it has one), loading the
        adapter into the least recently used free slot if needed. None: every slot is pinned by
        other adapters' work. UnknownAdapterError: `name` is not served."""
        if owner in self.owner_slot:
            return self.owner_slot[owner]
        if name not in self.known:
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded here")
        index = next((i for i, s in enumerate(self.slots) if s.name == name), None)
        if index is None:
            index = self._free_slot()
            if index is None:
                return None
            self._write(index, name)
        self._pin(index, owner)
        return index

    def share(self, owner: Hashable, new_owner: Hashable) -> int:
        """new_owner runs with owner's slot too (the sequences of an n > 1 request); -1 without."""
        index = self.owner_slot.get(owner)
        if index is None:
            return -1
        self._pin(index, new_owner)
        return index

    def transfer(self, owner: Hashable, new_owner: Hashable) -> int:
        """owner's pin becomes new_owner's (a reservation's, to the request it became); -1 without."""
        index = self.share(owner, new_owner)
        self.release(owner)
        return index

    def release(self, owner: Hashable) -> None:
        index = self.owner_slot.pop(owner, None)
        if index is not None:
            self.slots[index].owners.discard(owner)

    @property
    def pinned(self) -> int:
        return len(self.owner_slot)

    def _pin(self, index: int, owner: Hashable) -> None:
        self._clock += 1
        slot = self.slots[index]
        slot.owners.add(owner)
        slot.last_used = self._clock
        self.owner_slot[owner] = index

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one nobody pins."""
        idle = [i for i, s in enumerate(self.slots) if not s.owners]
        if not idle:
            return None
        empty = [i for i in idle if self.slots[i].name is None]
        return empty[0] if empty else min(idle, key=lambda i: self.slots[i].last_used)

    def _write(self, index: int, name: str) -> None:
        adapter = self.host.get(name)
        if adapter is None:  # evicted from host memory: read it again
            adapter = read_adapter(name, self.known[name], self.cfg, self.max_rank)
        self._keep(adapter)
        write_slot(self, index, adapter)
        self.slots[index].name = name
        if self.mirror is not None:
            self.mirror(name, adapter.path, index)

    def _keep(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.host_slots:
            self.host.popitem(last=False)


def write_slot(manager: LoraManager, index: int, adapter: LoraAdapter) -> None:
    """Every hooked linear's slot `index` gets the adapter's A and B (zeros where it adapts nothing)."""
    for (layer, linear), hook in manager.hooks.items():
        hook.write(index, [adapter.weights.get((layer, module)) for module in LINEAR_PARTS[linear]])
    manager.step.scales[index:index + 1].fill_(adapter.scale)


def follower_write_slot(engine, name: str, path: str, index: int) -> None:
    """A TP follower writes its shard of the adapter into slot `index` (rank 0 chose it)."""
    manager = engine.lora
    adapter = manager.host.get(name)
    if adapter is None or adapter.path != path:
        adapter = read_adapter(name, path, manager.cfg, manager.max_rank)
        manager._keep(adapter)
    write_slot(manager, index, adapter)
    manager.slots[index].name = name
