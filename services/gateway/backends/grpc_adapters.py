"""LoRA adapters loaded and unloaded at run time on the split stack: the gateway tells every live
worker of its model (the Adapters RPCs, services/worker_runtime/adapters.py), then waits until
their registry entries say so, so that when /v1/load_lora_adapter answers, /v1/models lists the
adapter and the router routes to it. A load that some worker refuses is undone on the others
(nobody serves half an adapter). What is loaded is kept in the registry (`<prefix>:model:<m>:lora`,
name -> folder) so that a worker that starts later, or again, loads it too
(services/worker_runtime/adapters.py). That record has no TTL and no worker writes it, so a Redis
restarted empty would lose it: every few seconds a gateway looks for the record's `lora:kept`
key, set with every write and never removed, and where Redis lost it writes the record back
from what the live workers serve and publish as loaded at run time, and what it loaded itself
(`RuntimeAdapters`), so a gateway restarted with Redis puts it back too."""
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
        """Write back a model's record where Redis lost it (restarted empty: its `lora:kept` key
        is gone, which no gateway removes): the adapters a live worker of the model serves, with
        the folders the workers publish as loaded at run time (`WorkerAdapters.runtime`, so a
        gateway started again with Redis knows them) and those this gateway loaded for that model.
        A record that stands, empty or not, is as the gateways left it (an unload the workers'
        next heartbeat has not shown yet, a load under way). The names written; [] while Redis is
        down."""
        written = []
        try:
            for model in _models(watcher):
                workers = [w for w in watcher.workers() if w.model == model]
                served = set(served_adapters(workers))
                mine = {name: path for name, path in self.paths.items() if self.models.get(name, model) == model}
                published = {name: path for w in workers for name, path in w.adapters.runtime.items()}
                wanted = {name: path for name, path in {**mine, **published}.items() if name in served}
                if not wanted or await watcher.client.exists(watcher.keys.lora_kept(model)):
                    continue
                await watcher.client.set(watcher.keys.lora_kept(model), "1")
                await watcher.client.hset(watcher.keys.lora_adapters(model), mapping=wanted)
                written += sorted(wanted)
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
    # the record stands from here (RuntimeAdapters.restore leaves it alone): the workers that load
    # first publish the adapter before the others answer, and a load undone must not be recorded
    await _remember(watcher, None)
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
    await _remember(watcher, lambda client, key: client.hdel(key, name))
    if not holders:
        raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
    await _unload(channels, holders, name, timeout_s)
    log.info("LoRA adapter %s unloaded from %d workers", name, len(holders))
    await _until(watcher, lambda ws: all(name not in w.adapters.served for w in ws), {w.worker_id for w in holders})


async def _remember(watcher, change) -> None:
    """Apply change(client, key) to the registry's record of run-time adapters (a worker that
    starts later reads it), None: no change, and mark the record as standing (`lora:kept`); a
    Redis outage leaves the live workers as they are told."""
    try:
        for model in _models(watcher):
            await watcher.client.set(watcher.keys.lora_kept(model), "1")
            if change is not None:
                await change(watcher.client, watcher.keys.lora_adapters(model))
    except Exception as exc:  # noqa: BLE001 - the workers have it; only later ones would miss it
        log.warning("could not record the LoRA change in the registry: %s", exc)


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
