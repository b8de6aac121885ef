"""LoRA adapters loaded and unloaded at run time on the split stack: the gateway tells every live
worker of its model (the Adapters RPCs, services/worker_runtime/adapters.py), then waits until
their registry entries say so, so that when /v1/load_lora_adapter answers, /v1/models lists the
adapter and the router routes to it. A load that some worker refuses is undone on the others
(nobody serves half an adapter). What is loaded is kept in the registry (`<prefix>:model:<m>:lora`,
name -> folder) so that a worker that starts later, or again, loads it too
(services/worker_runtime/adapters.py). That record has no TTL and no worker writes it, so a Redis
restarted empty would lose it: the gateway keeps what it loaded (`RuntimeAdapters`) and writes
back, every few seconds, the entries of it that a live worker still serves and the record lacks."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.gateway.backends.interface import AdapterNotFound, BackendBadRequest, BackendUnavailable
from shared.registry.worker_info import WorkerInfo

log = logging.getLogger("duet.gateway.lora")
UNLOADED_S = 60  # how long an unloaded name stays marked (the workers show it gone within a heartbeat)

VISIBLE_WITHIN_S = 5.0  # a heartbeat and a registry scan, with room


def served_adapters(workers: list[WorkerInfo]) -> list[str]:
    """Every adapter some live worker serves."""
    return sorted({name for w in workers for name in w.adapters.served})


def _ref(w: WorkerInfo) -> duet_pb2.WorkerRef:
    return duet_pb2.WorkerRef(worker_id=w.worker_id, address=w.address, instance_nonce=w.instance_nonce)


def _stub(channels, w: WorkerInfo) -> duet_pb2_grpc.AdaptersStub:
    # a worker's certificate names the services of its role; a `both` worker's includes decode
    return duet_pb2_grpc.AdaptersStub(channels.get(_ref(w), "prefill" if w.role == "prefill" else "decode"))


@dataclass
class RuntimeAdapters:
    """The adapters this gateway loaded at run time: name -> folder, and the base model whose
    workers serve it."""

    paths: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)

    def remember(self, name: str, path: str, model: str) -> None:
        self.paths[name], self.models[name] = path, model

    def forget(self, name: str) -> None:
        self.paths.pop(name, None)
        self.models.pop(name, None)

    async def restore(self, watcher) -> list[str]:
        """Write back the record's entries a live worker of the adapter's model serves and the
        registry lost (a Redis restarted empty), each into its own model's record: those this
        gateway loaded, and, where the model's record is gone whole, those the workers say they
        loaded at run time (`WorkerAdapters.runtime`: a gateway started again with Redis knows them
        from there; a record that lacks only some names, or a name just unloaded (_forget's mark),
        is an unload the workers' next heartbeat has not shown yet). An adapter unloaded since (by
        any gateway: no worker serves it) stays out. The names written; [] while Redis is down."""
        written = []
        try:
            for model in _models(watcher):
                workers = [w for w in watcher.workers() if w.model == model]
                served = set(served_adapters(workers))
                published = {name: path for w in workers for name, path in w.adapters.runtime.items()}
                if not (published or self.paths):
                    continue
                key = watcher.keys.lora_adapters(model)
                known = {k.decode() if isinstance(k, bytes) else k for k in await watcher.client.hkeys(key)}
                if known:  # the record is there: the workers' lists only lag what it says
                    published = {}
                for name in list(published):
                    if await watcher.client.exists(_unloaded(key, name)):
                        del published[name]  # unloaded a moment ago, the workers' entries not there yet
                wanted = {**published, **self.paths}
                missing = {name: path for name, path in wanted.items()
                           if name in served and name not in known and self.models.get(name, model) == model}
                if missing:
                    await watcher.client.hset(key, mapping=missing)
                    written += sorted(missing)
        except Exception as exc:  # noqa: BLE001 - Redis down: the next pass tries again
            log.debug("could not restore the LoRA record: %s", exc)
            return []
        if written:
            log.info("the registry had lost LoRA adapters loaded at run time; recorded again: %s", written)
        return written


async def load_everywhere(watcher, channels, name: str, path: str, timeout_s: float) -> None:
    workers = watcher.workers()
    if not workers:
        raise BackendUnavailable("no live worker to load the LoRA adapter on")
    request = duet_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
    results = await asyncio.gather(*(_stub(channels, w).LoadLoraAdapter(request, timeout=timeout_s)
                                     for w in workers), return_exceptions=True)
    loaded, failure = [], None
    for w, result in zip(workers, results):
        if not isinstance(result, BaseException):
            loaded.append(w)
        elif not (isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.ALREADY_EXISTS):
            failure = failure or (w, result)
    if failure is not None:
        await _unload(channels, loaded, name, timeout_s)  # nobody serves half an adapter
        w, exc = failure
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                                    grpc.StatusCode.FAILED_PRECONDITION):
            raise BackendBadRequest(exc.details() or str(exc), "lora_path")
        raise BackendUnavailable(f"worker {w.worker_id} could not load the LoRA adapter: {exc}")
    log.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))
    await _remember(watcher, lambda client, key: client.hset(key, name, path))
    await _until(watcher, lambda ws: all(name in w.adapters.served for w in ws), {w.worker_id for w in workers})


async def unload_everywhere(watcher, channels, name: str, timeout_s: float) -> None:
    holders = [w for w in watcher.workers() if name in w.adapters.served]
    # the record goes even when nobody live serves it (a pool restarting, a registry lagging),
    # so the pool's next worker does not load what the client asked to remove
    await _remember(watcher, lambda client, key: _forget(client, key, name))
    if not holders:
        raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
    await _unload(channels, holders, name, timeout_s)
    log.info("LoRA adapter %s unloaded from %d workers", name, len(holders))
    await _until(watcher, lambda ws: all(name not in w.adapters.served for w in ws), {w.worker_id for w in holders})


async def _remember(watcher, change) -> None:
    """Apply change(client, key) to the registry's record of run-time adapters (a worker that
    starts later reads it); a Redis outage leaves the live workers as they are told."""
    try:
        for model in _models(watcher):
            await change(watcher.client, watcher.keys.lora_adapters(model))
    except Exception as exc:  # noqa: BLE001 - the workers have it; only later ones would miss it
        log.warning("could not record the LoRA change in the registry: %s", exc)


async def _forget(client, key: str, name: str) -> None:
    """Take `name` out of the record, leaving a mark for UNLOADED_S: until the workers' next
    heartbeats the live entries still list it as loaded at run time, and a record gone whole
    would otherwise be written back from them (RuntimeAdapters.restore)."""
    await client.set(_unloaded(key, name), "1", ex=UNLOADED_S)
    await client.hdel(key, name)


def _unloaded(key: str, name: str) -> str:
    return f"{key}:unloaded:{name}"


def _models(watcher) -> set[str]:
    return {watcher.model} if watcher.model else {w.model for w in watcher.workers()}


async def _unload(channels, workers: list[WorkerInfo], name: str, timeout_s: float) -> None:
    request = duet_pb2.UnloadLoraAdapterRequest(lora_name=name)
    results = await asyncio.gather(*(_stub(channels, w).UnloadLoraAdapter(request, timeout=timeout_s)
                                     for w in workers), return_exceptions=True)
    for w, result in zip(workers, results):
        if isinstance(result, BaseException) and not (
                isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.NOT_FOUND):
            log.warning("worker %s did not unload LoRA adapter %s: %s", w.worker_id, name, result)


async def _until(watcher, done, worker_ids: set[str]) -> None:
    """Wait (bounded) until the registry entries of those workers still live satisfy done."""
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while time.monotonic() < deadline:
        if done([w for w in watcher.workers() if w.worker_id in worker_ids]):
            return
        await asyncio.sleep(0.05)
    log.warning("the registry did not show the LoRA change within %.0fs", VISIBLE_WITHIN_S)
