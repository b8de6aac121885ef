"""The registry's record of the LoRA adapters loaded at run time (`<prefix>:model:<m>:lora`, read
by workers that start later) survives a Redis restarted empty: the gateway writes back what it
loaded and a live worker still serves (services/gateway/backends/grpc_adapters.py,
RuntimeAdapters), never an adapter no worker serves any more. Real redis-server, the real
publisher and watcher."""
from __future__ import annotations

import asyncio

from services.gateway.backends.grpc_adapters import RuntimeAdapters
from shared.registry.config import RegistryConfig
from shared.registry.publisher import WorkerPublisher
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import WorkerAdapters, WorkerInfo
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

MODEL = "tiny"
KEY = f"duet:model:{MODEL}:lora"
KEPT = f"{KEY}:kept"  # set with every write of the record by a gateway: missing, Redis lost it


def test_a_redis_restarted_empty_gets_the_run_time_adapters_back(redis_server):
    async def scenario():
        config = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                                socket_timeout_s=0.5)
        info = WorkerInfo(worker_id="d1", role="decode", address="d1.svc:7000", model=MODEL, page_size=16,
                          compat_hash="c1", adapters=WorkerAdapters(served=["sql", "chat"]))
        publisher = WorkerPublisher(info, config)
        watcher = WorkerWatcher(config, model=MODEL)
        record = RuntimeAdapters({"sql": "/adapters/sql", "chat": "/adapters/chat", "gone": "/adapters/gone"})
        await publisher.start()
        await watcher.start()
        try:
            assert await publisher.wait_registered(5)
            assert await watcher.wait_for(lambda w: w.is_live("d1"), 5)
            await watcher.client.hset(KEY, mapping={"sql": "/adapters/sql", "chat": "/adapters/chat"})
            await watcher.client.set(KEPT, "1")  # as a gateway's write leaves it
            assert await record.restore(watcher) == []  # nothing lost
            await watcher.client.flushall()  # as a Redis restarted without persistence
            assert sorted(await record.restore(watcher)) == ["chat", "sql"]  # "gone": no worker serves it
            held = await watcher.client.hgetall(KEY)
            assert {k.decode(): v.decode() for k, v in held.items()} == {"sql": "/adapters/sql",
                                                                        "chat": "/adapters/chat"}
        finally:
            await watcher.stop()
            await publisher.stop()

    asyncio.run(scenario())


def test_a_gateway_of_two_models_writes_each_adapter_back_into_its_own_models_record(redis_server):
    """An adapter fits one model's shapes: written into another model's record, that model's next
    worker would try to load it at start."""
    async def scenario():
        config = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                                socket_timeout_s=0.5)
        workers = [WorkerInfo(worker_id=f"d-{model}", role="decode", address=f"{model}.svc:7000", model=model,
                              page_size=16, compat_hash="c1", adapters=WorkerAdapters(served=[adapter]))
                   for model, adapter in ((MODEL, "sql"), ("other", "poems"))]
        publishers = [WorkerPublisher(info, config) for info in workers]
        watcher = WorkerWatcher(config)  # every model's entries, as a gateway of several models watches
        record = RuntimeAdapters({"sql": "/adapters/sql", "poems": "/adapters/poems"},
                                 {"sql": MODEL, "poems": "other"})
        for p in publishers:
            await p.start()
        await watcher.start()
        try:
            assert await watcher.wait_for(lambda w: w.is_live(f"d-{MODEL}") and w.is_live("d-other"), 5)
            await watcher.client.flushall()
            assert sorted(await record.restore(watcher)) == ["poems", "sql"]
            held = {m: {k.decode(): v.decode() for k, v in (await watcher.client.hgetall(f"duet:model:{m}:lora")).items()}
                    for m in (MODEL, "other")}
            assert held == {MODEL: {"sql": "/adapters/sql"}, "other": {"poems": "/adapters/poems"}}, held
        finally:
            await watcher.stop()
            for p in publishers:
                await p.stop()

    asyncio.run(scenario())


def test_an_unload_nobody_serves_is_not_found_and_still_clears_the_record(redis_server):
    """A pool restarting (or a registry lagging) serves nothing: the unload answers 404, and the
    record goes anyway, so the pool's next worker does not load what the client removed."""
    import pytest

    from services.gateway.backends.grpc_adapters import unload_everywhere
    from services.gateway.backends.interface import AdapterNotFound

    async def scenario():
        config = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                                socket_timeout_s=0.5)
        watcher = WorkerWatcher(config, model=MODEL)
        await watcher.start()
        try:
            await watcher.client.hset(KEY, mapping={"sql": "/adapters/sql", "chat": "/adapters/chat"})
            with pytest.raises(AdapterNotFound):
                await unload_everywhere(watcher, None, "sql", 1.0)  # no live worker: no channel dialled
            held = await watcher.client.hgetall(KEY)
            assert {k.decode(): v.decode() for k, v in held.items()} == {"chat": "/adapters/chat"}
        finally:
            await watcher.stop()

    asyncio.run(scenario())


def test_a_gateway_restarted_with_redis_writes_the_record_back_from_what_the_workers_loaded(redis_server):
    """Redis and the gateway both restarted: the new gateway loaded nothing, but the live workers
    publish what they loaded at run time (`lora_runtime`), so the record comes back (a worker
    started later loads it: tests/disagg/test_worker_lora_record.py); an adapter a worker was
    started with (--lora, not in its `runtime`) is not put in the record. A record that stands
    (its `kept` key there), even empty, is left as the gateways left it: an unload the workers'
    next heartbeat has not shown yet, or a load under way, must not be written back."""
    from services.gateway.backends.grpc_adapters import _remember

    async def scenario():
        config = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                                socket_timeout_s=0.5)
        info = WorkerInfo(worker_id="d1", role="decode", address="d1.svc:7000", model=MODEL, page_size=16,
                          compat_hash="c1", adapters=WorkerAdapters(served=["sql", "chat", "own"],
                                                                    runtime={"sql": "/adapters/sql",
                                                                             "chat": "/adapters/chat"}))
        publisher = WorkerPublisher(info, config)
        watcher = WorkerWatcher(config, model=MODEL)
        restarted = RuntimeAdapters()  # a gateway started again: it loaded nothing itself
        stale = RuntimeAdapters({"sql": "/adapters/sql-before"}, {"sql": MODEL})  # it remembers an older folder
        await publisher.start()
        await watcher.start()
        try:
            assert await watcher.wait_for(lambda w: w.is_live("d1"), 5)
            assert watcher.workers()[0].adapters.runtime == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
            await watcher.client.flushall()  # Redis restarted empty
            assert sorted(await restarted.restore(watcher)) == ["chat", "sql"]
            held = await watcher.client.hgetall(KEY)
            assert {k.decode(): v.decode() for k, v in held.items()} == {"sql": "/adapters/sql",
                                                                        "chat": "/adapters/chat"}
            assert await stale.restore(watcher) == [] and await watcher.client.exists(KEPT)  # it stands now
            # both unloaded by a gateway (its hdel; the workers' entries a heartbeat behind): the
            # record is gone whole but stands
            await watcher.client.hdel(KEY, "sql", "chat")
            assert not await watcher.client.exists(KEY) and await restarted.restore(watcher) == []
            # a load under way marks the record standing before any worker loads
            await watcher.client.flushall()
            await _remember(watcher, None)
            assert await restarted.restore(watcher) == []
            # what the workers serve wins over a folder a gateway remembers from before
            await watcher.client.flushall()
            assert sorted(await stale.restore(watcher)) == ["chat", "sql"]
            assert (await watcher.client.hget(KEY, "sql")).decode() == "/adapters/sql"
        finally:
            await watcher.stop()
            await publisher.stop()

    asyncio.run(scenario())
