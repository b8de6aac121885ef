"""Registry against a real redis-server: register, heartbeat, TTL, watcher, outage."""
from __future__ import annotations

import asyncio
import json
import time

import redis

from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.kv_events import cached_prefix_pages
from shared.registry.peers import PeerNotFound, connect_sync, fetch_peer_sync
from shared.registry.prefix_hashes import chained_page_hashes
from shared.registry.publisher import HeartbeatThread, WorkerPublisher, connect_async
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import RankKvPool, WorkerInfo, WorkerLoad
from tests.helpers.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)


def fast_config(url: str) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=1.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                          socket_timeout_s=0.5)


def make_info(worker_id: str, role: str = "prefill", model: str = "m", compat: str = "c1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{abs(hash(worker_id)) % 50000 + 1000}",
                      model=model, metrics_address="127.0.0.1:9", tp=2, page_size=16, compat_hash=compat,
                      kv_pools=[RankKvPool(rank=r, agent_name=f"{worker_id}-r{r}", base_addr=4096 * (r + 1),
                                           page_bytes=1024, num_pages=64) for r in range(2)],
                      load=WorkerLoad(free_pages=60, total_pages=63))


def test_register_writes_hash_with_ttl_and_announces_join(redis_server):
    config = fast_config(redis_server.url)
    keys = RegistryKeys(config.prefix)
    sync = redis.Redis.from_url(config.redis_url)
    sub = sync.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(keys.events_channel)
    info = make_info("p-1")

    async def scenario():
        pub = WorkerPublisher(info, config, nixl_metadata={0: b"\x00md0\xff", 1: b"md1"})
        await pub.start()
        assert await pub.wait_registered(5)
        ttl_ms = sync.pttl(keys.worker("p-1"))
        assert 0 < ttl_ms <= 1000
        assert 0 < sync.pttl(keys.nixl("p-1")) <= 1000
        stored = WorkerInfo.from_hash(sync.hgetall(keys.worker("p-1")))
        assert stored.role == "prefill" and stored.address == info.address
        assert stored.agent_names == ["p-1-r0", "p-1-r1"] and stored.pool(1).base_addr == 8192
        assert stored.instance_nonce == info.instance_nonce
        # heartbeats keep it alive past the TTL and publish load
        pub.set_load(WorkerLoad(free_pages=7, total_pages=63, queued_prefill_tokens=123, running_requests=2,
                                kv_usage=0.5))
        await asyncio.sleep(1.5)
        again = WorkerInfo.from_hash(sync.hgetall(keys.worker("p-1")))
        assert again.load.queued_prefill_tokens == 123 and again.load.free_pages == 7
        assert again.heartbeat_seq >= 3
        peer = fetch_peer_sync(connect_sync(config), keys, "p-1")
        assert peer.nixl_metadata == {0: b"\x00md0\xff", 1: b"md1"}
        await pub.stop()
        assert not sync.exists(keys.worker("p-1"), keys.nixl("p-1"))

    asyncio.run(scenario())
    events = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and len(events) < 2:
        msg = sub.get_message(timeout=0.2)
        if msg:
            events.append(json.loads(msg["data"]))
    assert [e["event"] for e in events] == ["join", "leave"]
    assert events[0]["worker_id"] == "p-1" and events[0]["instance_nonce"] == info.instance_nonce
    try:
        fetch_peer_sync(connect_sync(config), keys, "p-1")
        raise AssertionError("deregistered worker still readable")
    except PeerNotFound:
        pass


def test_watcher_sees_join_quickly_and_crash_by_ttl(redis_server):
    # Scan rarely, so a fast appearance proves the join announcement path works.
    config = fast_config(redis_server.url)
    slow_scan = RegistryConfig(redis_url=config.redis_url, ttl_s=1.0, heartbeat_interval_s=0.2,
                               scan_interval_s=30.0)

    async def scenario():
        async with WorkerWatcher(slow_scan, model="m") as watcher:
            assert watcher.workers() == []
            pub = WorkerPublisher(make_info("d-1", role="decode"), config)
            await pub.start()
            t0 = time.monotonic()
            assert await watcher.wait_for(lambda w: w.is_live("d-1"), timeout=3)
            assert time.monotonic() - t0 < 2.0  # 30 s scan interval: only the join event explains this
            assert [w.worker_id for w in watcher.workers("decode")] == ["d-1"]
            assert watcher.workers("prefill") == []
            # crash: heartbeats stop, no deregistration -> only the TTL removes it
            await pub.stop(deregister=False)
        async with WorkerWatcher(config, model="m") as watcher:
            assert watcher.is_live("d-1")
            t0 = time.monotonic()
            assert await watcher.wait_for(lambda w: not w.is_live("d-1"), timeout=5)
            gone_after = time.monotonic() - t0
            assert gone_after < 1.0 + 0.2 + 0.5  # ttl + scan interval + slack

    asyncio.run(scenario())


def test_watcher_filters_model_and_compat_and_tracks_clean_leave(redis_server):
    config = fast_config(redis_server.url)

    async def scenario():
        pubs = [WorkerPublisher(make_info("a", model="m", compat="c1"), config),
                WorkerPublisher(make_info("b", model="m", compat="c2"), config),
                WorkerPublisher(make_info("c", model="other", compat="c1"), config)]
        for pub in pubs:
            await pub.start()
            assert await pub.wait_registered(5)
        async with WorkerWatcher(config, model="m", compat_hash="c1") as watcher:
            assert [w.worker_id for w in watcher.workers()] == ["a"]
        async with WorkerWatcher(config, model="m") as watcher:
            assert [w.worker_id for w in watcher.workers()] == ["a", "b"]
            await pubs[0].stop()  # clean leave: announced, watcher drops it without waiting for TTL
            assert await watcher.wait_for(lambda w: not w.is_live("a"), timeout=1.0)
        for pub in pubs[1:]:
            await pub.stop()

    asyncio.run(scenario())


def test_redis_outage_keeps_last_set_and_worker_reregisters(redis_server):
    config = fast_config(redis_server.url)

    async def scenario():
        pub = WorkerPublisher(make_info("p-9"), config, nixl_metadata={0: b"m0"})
        pub.kv_events.stored([11, 22])
        await pub.start()
        assert await pub.wait_registered(5)
        async with WorkerWatcher(config) as watcher:
            assert watcher.is_live("p-9")
            redis_server.stop()
            await asyncio.sleep(1.5)  # longer than the TTL: a live Redis would have expired it
            assert watcher.redis_ok is False
            assert watcher.is_live("p-9"), "Redis outage must not empty the worker set"
            assert pub.failed_beats > 0
            redis_server.start()  # same port, empty data
            # the heartbeat finds its entry gone, re-registers in full (hash, NIXL metadata, page set)
            assert await watcher.wait_for(lambda w: w.redis_ok and w.is_live("p-9") and w.scans > 0
                                          and pub.registrations >= 2, timeout=5)
        assert pub.registrations >= 2
        sync = redis.Redis.from_url(config.redis_url)
        keys = RegistryKeys(config.prefix)
        assert sync.hget(keys.nixl("p-9"), "0") == b"m0"
        assert sync.smembers(keys.pages("p-9")) == {b"11", b"22"}
        await pub.stop()

    asyncio.run(scenario())


def test_redis_restart_keeps_known_workers_for_a_ttl_then_drops_the_silent(redis_server):
    """A restarted (empty) Redis knows no worker until each re-registers at its next
    heartbeat: the watcher keeps its last set for one TTL after the outage instead of
    serving an empty set; a worker that never re-registers leaves after that TTL."""
    config = fast_config(redis_server.url)

    async def scenario():
        alive, silent = WorkerPublisher(make_info("p-7"), config), WorkerPublisher(make_info("p-8"), config)
        for pub in (alive, silent):
            await pub.start()
            assert await pub.wait_registered(5)
        async with WorkerWatcher(config) as watcher:
            assert watcher.is_live("p-7") and watcher.is_live("p-8")
            await silent.stop(deregister=False)  # its entry expires with the outage; it never comes back
            redis_server.stop()
            await asyncio.sleep(0.6)
            assert watcher.redis_ok is False
            redis_server.start()  # same port, empty
            assert await watcher.wait_for(lambda w: w.redis_ok, timeout=5)
            assert watcher.is_live("p-7") and watcher.is_live("p-8"), "an empty Redis emptied the set"
            assert await watcher.wait_for(lambda w: not w.is_live("p-8"), timeout=5)
        await alive.stop()

    asyncio.run(scenario())


def test_heartbeat_thread_from_sync_code(redis_server):
    config = fast_config(redis_server.url)
    keys = RegistryKeys(config.prefix)
    sync = redis.Redis.from_url(config.redis_url)
    pub = WorkerPublisher(make_info("s-1", role="both"), config)
    thread = HeartbeatThread(pub)
    assert thread.start(wait_registered_s=5)
    pub.set_load(WorkerLoad(running_requests=5, free_pages=3, total_pages=10, kv_usage=0.7))
    pub.kv_events.stored([1, 2, 3])
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if sync.hget(keys.worker("s-1"), "load_running_requests") == b"5" and sync.scard(keys.pages("s-1")) == 3:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("load / page hashes were not published by the heartbeat thread")
    pub.kv_events.removed([2])
    deadline = time.monotonic() + 3
    while sync.smembers(keys.pages("s-1")) != {b"1", b"3"}:
        assert time.monotonic() < deadline, "removed page hash not published"
        time.sleep(0.05)
    pub.kv_events.offloaded([3])  # the device gave page 3 up to the host tier: still held
    deadline = time.monotonic() + 3
    while sync.smembers(keys.host_pages("s-1")) != {b"3"}:
        assert time.monotonic() < deadline, "host-tier page hash not published"
        time.sleep(0.05)
    assert sync.smembers(keys.pages("s-1")) == {b"1", b"3"}
    pub.kv_events.loaded([3])
    deadline = time.monotonic() + 3
    while sync.scard(keys.host_pages("s-1")):
        assert time.monotonic() < deadline, "page loaded back not published"
        time.sleep(0.05)
    thread.stop()
    assert not sync.exists(keys.worker("s-1")) and not sync.exists(keys.host_pages("s-1"))


def test_prefix_hashes_and_cached_prefix_lookup(redis_server):
    page = 4
    a = list(range(100, 117))            # 4 full pages + 1 token
    b = a[:8] + [7, 7, 7, 7] + a[12:]    # same first 2 pages, differs in page 2
    ha, hb = chained_page_hashes(a, page), chained_page_hashes(b, page)
    assert len(ha) == 4 and ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]  # chained: differs after too
    assert chained_page_hashes(a[:3], page) == []
    assert all(0 <= h < 2**64 for h in ha)
    config = fast_config(redis_server.url)
    keys = RegistryKeys(config.prefix)

    async def scenario():
        pub_a = WorkerPublisher(make_info("pa"), config)
        pub_b = WorkerPublisher(make_info("pb"), config)
        pub_a.kv_events.stored(ha)          # holds all of prompt a
        pub_b.kv_events.stored(hb[:3])      # holds 2 pages shared with a, then b's own page
        for pub in (pub_a, pub_b):
            await pub.start()
            assert await pub.wait_registered(5)
        client = connect_async(config)
        counts = await cached_prefix_pages(client, {"pa": keys.pages("pa"), "pb": keys.pages("pb"),
                                                    "none": keys.pages("none")}, ha)
        assert counts == {"pa": 4, "pb": 2, "none": 0}
        await client.aclose()
        for pub in (pub_a, pub_b):
            await pub.stop()

    asyncio.run(scenario())


def test_redis_server_helper_restart_same_port():
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        port = server.port
        server.stop()
        assert not server.running
        server.start()
        assert server.port == port and redis.Redis.from_url(server.url).get("k") is None


def test_peer_lookup_survives_a_redis_restart():
    """A pooled connection to a Redis that restarted fails once; the lookup retries on a
    fresh connection instead of failing the request that needed the peer."""
    import asyncio

    import redis as redis_sync
    import redis.asyncio as aioredis

    from shared.registry.keys import RegistryKeys
    from shared.registry.peers import fetch_peer, fetch_peer_sync
    from tests.helpers.redis_server import RedisServer

    keys = RegistryKeys("duet")
    info = WorkerInfo(worker_id="d1", role="decode", address="x:1", model="m")
    server = RedisServer()
    server.start()
    try:
        def register():
            with redis_sync.Redis.from_url(server.url) as r:
                r.hset(keys.worker("d1"), mapping=info.to_hash())
                r.hset(keys.nixl("d1"), mapping={"0": b"meta"})

        async def scenario():
            client = aioredis.Redis.from_url(server.url)
            sync_client = redis_sync.Redis.from_url(server.url)
            register()
            assert (await fetch_peer(client, keys, "d1")).nixl_metadata == {0: b"meta"}
            assert fetch_peer_sync(sync_client, keys, "d1").info.worker_id == "d1"
            server.stop()
            server.start()  # same port, empty: the pooled connections are stale
            register()
            assert (await fetch_peer(client, keys, "d1")).nixl_metadata == {0: b"meta"}
            assert fetch_peer_sync(sync_client, keys, "d1").info.worker_id == "d1"
            await client.aclose()
            sync_client.close()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_watcher_stops_when_redis_swallows_the_cancellation():
    """redis-py swallows a cancellation that lands while its pub/sub connection is being set up,
    so the event loop, cancelled right after start(), would read messages forever and a stopping
    worker would wait on it forever (seen as a worker that never exited after SIGTERM). stop()
    ends every loop anyway, within a second."""
    server = RedisServer()
    server.start()
    try:
        async def scenario():
            took = []
            for _ in range(5):
                watcher = WorkerWatcher(fast_config(server.url))
                await watcher.start()
                tasks = list(watcher._tasks)
                t0 = time.monotonic()
                await asyncio.wait_for(watcher.stop(timeout_s=5.0), 10)
                took.append(time.monotonic() - t0)
                assert all(t.done() for t in tasks), tasks  # ended, not left behind
            return took

        took = asyncio.run(scenario())
        assert max(took) < 4.5, took  # the loops ended on their own, before stop() would give up (5 s)
    finally:
        server.stop()


def test_watcher_stop_is_bounded_when_a_loop_never_ends():
    """A loop that ignores both its cancellation and the stop flag (a library call that never
    returns) is left behind after stop()'s bound: a stopping process must not hang on it."""
    server = RedisServer()
    server.start()
    try:
        async def scenario():
            watcher = WorkerWatcher(fast_config(server.url))
            await watcher.start()
            release = asyncio.Event()

            async def stubborn():
                while not release.is_set():
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        pass  # swallowed

            watcher._tasks.append(asyncio.create_task(stubborn()))
            await asyncio.sleep(0)
            t0 = time.monotonic()
            try:
                await watcher.stop(timeout_s=0.5)
                return time.monotonic() - t0, watcher._client, watcher._tasks
            finally:
                release.set()  # it ends at its next wake-up, so asyncio.run can finish

        took, client, tasks = asyncio.run(scenario())
        assert 0.5 <= took < 3.0, took
        assert client is None and tasks == []
    finally:
        server.stop()
