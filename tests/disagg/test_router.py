"""Router through real gRPC against a real Redis registry.

The workers here are registry entries published by WorkerPublisher (what real
workers run); the router only ever reads the registry, so this is the real path.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses

import grpc
import pytest
import redis.asyncio

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.server import RouterServer
from shared.registry.config import RegistryConfig
from shared.registry.prefix_hashes import chained_page_hashes
from shared.registry.publisher import WorkerPublisher
from shared.registry.worker_info import WorkerInfo, WorkerLoad
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

PAGE = 16


def registry(url: str) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=1.0, heartbeat_interval_s=0.2, scan_interval_s=0.2,
                          socket_timeout_s=0.5)


def worker(worker_id: str, role: str, compat: str = "c1", model: str = "tiny", **load) -> WorkerInfo:
    load = {"free_pages": 1000, "total_pages": 1000, **load}
    return WorkerInfo(worker_id=worker_id, role=role, address=f"{worker_id}.svc:7000", model=model,
                      page_size=PAGE, compat_hash=compat, load=WorkerLoad(**load))


class Cluster:
    """Router server + client + publishers in one event loop."""

    def __init__(self, url: str, model: str = "tiny", registry_config: RegistryConfig | None = None):
        self.config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model=model,
                                   registry=registry_config or registry(url))
        self.server = RouterServer(self.config)
        self.publishers: dict[str, WorkerPublisher] = {}

    async def __aenter__(self) -> "Cluster":
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = duet_pb2_grpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        for pub in self.publishers.values():
            await pub.stop()
        await self.channel.close()
        await self.server.stop()

    async def add(self, info: WorkerInfo, hashes: list[int] = ()) -> WorkerPublisher:
        pub = WorkerPublisher(info, self.config.registry)
        pub.kv_events.stored(hashes)
        await pub.start()
        assert await pub.wait_registered(5)
        self.publishers[info.worker_id] = pub
        return pub

    async def wait_live(self, *ids: str, gone: tuple[str, ...] = (), timeout: float = 5.0) -> None:
        watcher = self.server.watcher
        ok = await watcher.wait_for(lambda w: all(w.is_live(i) for i in ids) and not any(w.is_live(g) for g in gone),
                                    timeout)
        assert ok, f"router never saw live={ids} gone={gone}: {[w.worker_id for w in watcher.workers()]}"

    async def route(self, prompt_tokens: int = 100, max_tokens: int = 50, page_hashes=(), request_id: str = ""):
        return await self.stub.Route(duet_pb2.RouteRequest(
            request_id=request_id, prompt_tokens=prompt_tokens, max_tokens=max_tokens, page_hashes=page_hashes))


async def expect_unavailable(cluster: Cluster) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.route()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return info.value.details()


def test_registration_appears_and_ttl_expiry_removes(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            assert "no live worker" in await expect_unavailable(c)
            await c.add(worker("p1", "prefill"))
            await c.add(worker("d1", "decode"))
            await c.add(worker("d2", "decode"))
            await c.wait_live("p1", "d1", "d2")
            reply = await c.route(request_id="r-1")
            assert reply.request_id == "r-1" and not reply.colocated
            assert reply.prefill.worker_id == "p1" and reply.prefill.address == "p1.svc:7000"
            assert reply.decode.worker_id in ("d1", "d2")
            assert reply.decode.instance_nonce == c.publishers[reply.decode.worker_id].info.instance_nonce
            # d1 crashes (no deregistration): the TTL removes it and the router stops choosing it
            await c.publishers.pop("d1").stop(deregister=False)
            await c.wait_live("d2", gone=("d1",), timeout=3)
            decodes = {(await c.route()).decode.worker_id for _ in range(6)}
            assert decodes == {"d2"}
            # the last decode dies too: no pair and no `both` worker -> UNAVAILABLE
            await c.publishers.pop("d2").stop(deregister=False)
            await c.wait_live(gone=("d2",), timeout=3)
            await expect_unavailable(c)

    asyncio.run(scenario())


def test_load_balanced_across_two_plus_two(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            for info in (worker("p1", "prefill"), worker("p2", "prefill"),
                         worker("d1", "decode"), worker("d2", "decode")):
                await c.add(info)
            await c.wait_live("p1", "p2", "d1", "d2")
            replies = [await c.route(request_id=f"r{i}") for i in range(40)]
            prefills = collections.Counter(r.prefill.worker_id for r in replies)
            decodes = collections.Counter(r.decode.worker_id for r in replies)
            assert prefills == {"p1": 20, "p2": 20}, prefills
            assert decodes == {"d1": 20, "d2": 20}, decodes
            # releasing p1's requests makes p1 the cheaper prefill again
            for r in replies:
                if r.prefill.worker_id == "p1":
                    released = await c.stub.Release(duet_pb2.ReleaseRequest(
                        request_id=r.request_id, stage=duet_pb2.RELEASE_STAGE_PREFILL_DONE))
                    assert released.found
            assert (await c.route()).prefill.worker_id == "p1"
            gone = await c.stub.Release(duet_pb2.ReleaseRequest(request_id="nope"))
            assert not gone.found

    asyncio.run(scenario())


def test_reported_load_and_later_worker(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(worker("p1", "prefill", queued_prefill_tokens=5000))
            await c.add(worker("d1", "decode", free_pages=100, total_pages=1000, running_requests=40))
            await c.wait_live("p1", "d1")
            assert (await c.route()).prefill.worker_id == "p1"
            # a prefill that registers later (idle) is picked while p1 reports a long queue
            await c.add(worker("p2", "prefill"))
            await c.add(worker("d2", "decode", free_pages=900, total_pages=1000, running_requests=1))
            await c.wait_live("p2", "d2")
            reply = await c.route()
            assert reply.prefill.worker_id == "p2" and reply.decode.worker_id == "d2"
            # load published by heartbeat moves traffic: d2 fills up, d1 drains
            c.publishers["d2"].set_load(WorkerLoad(free_pages=10, total_pages=1000, running_requests=200))
            c.publishers["d1"].set_load(WorkerLoad(free_pages=990, total_pages=1000, running_requests=0))
            ok = await c.server.watcher.wait_for(
                lambda w: w.get("d2").load.free_pages == 10 and w.get("d1").load.free_pages == 990, 3)
            assert ok
            assert (await c.route()).decode.worker_id == "d1"

    asyncio.run(scenario())


def test_prefix_affinity_without_pinning(redis_server):
    async def scenario():
        prompt = list(range(1000, 1000 + 20 * PAGE))          # 20 full pages = 320 tokens
        hashes = chained_page_hashes(prompt, PAGE)
        async with Cluster(redis_server.url) as c:
            await c.add(worker("p1", "prefill"), hashes=hashes[:15])  # holds a 240-token prefix
            await c.add(worker("p2", "prefill"))
            await c.add(worker("d1", "decode"))
            await c.wait_live("p1", "p2", "d1")
            first = await c.route(prompt_tokens=len(prompt), page_hashes=hashes)
            assert first.prefill.worker_id == "p1" and first.cached_tokens == 15 * PAGE
            picks = [(await c.route(prompt_tokens=len(prompt), page_hashes=hashes)).prefill.worker_id
                     for _ in range(12)]
            # p1 keeps most of the traffic (it skips 240 of 320 tokens) but its queue grows,
            # so p2 takes some: one hot prefix must not pin everything to one worker
            assert picks.count("p1") > picks.count("p2") > 0, picks
            # without hashes the choice is on load only
            other = await c.route(prompt_tokens=len(prompt))
            assert other.cached_tokens == 0

    asyncio.run(scenario())


def test_fallback_to_both_and_compat_pairing(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(worker("b1", "both"))
            await c.add(worker("b2", "both"))
            await c.wait_live("b1", "b2")
            replies = [await c.route() for _ in range(4)]
            assert all(r.colocated and not r.HasField("prefill") for r in replies)
            assert collections.Counter(r.decode.worker_id for r in replies) == {"b1": 2, "b2": 2}
            # a prefill and a decode that cannot pair (different compat hash): still colocated
            await c.add(worker("p1", "prefill", compat="c1"))
            await c.add(worker("d9", "decode", compat="c9"))
            await c.wait_live("p1", "d9")
            assert (await c.route()).colocated
            # a compatible decode arrives: split serving
            await c.add(worker("d1", "decode", compat="c1"))
            await c.wait_live("d1")
            reply = await c.route()
            assert not reply.colocated and (reply.prefill.worker_id, reply.decode.worker_id) == ("p1", "d1")
            # workers of another model are never chosen
            await c.add(worker("x-p", "prefill", model="big"))
            await c.add(worker("x-d", "decode", model="big"))
            await asyncio.sleep(0.5)
            ids = {(await c.route()).prefill.worker_id for _ in range(4)}
            assert ids == {"p1"}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.Route(duet_pb2.RouteRequest(prompt_tokens=0))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())


def test_a_migrating_request_never_gets_a_lost_instance_or_another_checkpoint(redis_server):
    """A moved stream's Route names the instances it lost and the checkpoint it began on: the
    router chooses neither a lost instance nor a worker of another checkpoint (a rolling
    upgrade serving two under one name: their compat hashes differ too, so they never pair)."""
    def ckpt(worker_id: str, role: str, checkpoint: str) -> WorkerInfo:
        info = worker(worker_id, role, compat=f"c-{checkpoint}")
        info.checkpoint = checkpoint
        return info

    async def scenario():
        async with Cluster(redis_server.url) as c:
            for info in (ckpt("p-old", "prefill", "old"), ckpt("d-old", "decode", "old"),
                         ckpt("p-new", "prefill", "new"), ckpt("d-new1", "decode", "new"),
                         ckpt("d-new2", "decode", "new")):
                await c.add(info)
            await c.wait_live("p-old", "d-old", "p-new", "d-new1", "d-new2")
            first = await c.route()
            pairs = {(first.prefill.worker_id, first.decode.worker_id)}
            assert pairs <= {("p-old", "d-old"), ("p-new", "d-new1"), ("p-new", "d-new2")}
            lost = c.publishers["d-new1"].info.instance_nonce
            for _ in range(6):
                reply = await c.stub.Route(duet_pb2.RouteRequest(prompt_tokens=100, max_tokens=50,
                                                                 exclude_instances=[lost], checkpoint="new"))
                assert (reply.prefill.worker_id, reply.decode.worker_id, reply.checkpoint) == ("p-new", "d-new2", "new")
            with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing of that checkpoint left
                await c.stub.Route(duet_pb2.RouteRequest(
                    prompt_tokens=100, max_tokens=50, checkpoint="new",
                    exclude_instances=[lost, c.publishers["d-new2"].info.instance_nonce]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_handed_over_stream_may_be_prefilled_by_the_worker_that_handed_it_but_not_decoded_there(redis_server):
    """A stream handed over names its old worker in exclude_decode_instances: as a prefill
    worker it is still chosen (it holds the stream's pages, which then move), as a decode or
    `both` worker never."""
    async def scenario():
        async with Cluster(redis_server.url) as c:
            for info in (worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode")):
                await c.add(info)
            await c.wait_live("p0", "d0", "d1")
            p0, d0 = (c.publishers[w].info.instance_nonce for w in ("p0", "d0"))
            for _ in range(6):
                reply = await c.stub.Route(duet_pb2.RouteRequest(prompt_tokens=100, max_tokens=50,
                                                                 exclude_decode_instances=[p0, d0]))
                assert (reply.prefill.worker_id, reply.decode.worker_id) == ("p0", "d1")
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no decode worker left to take it
                await c.stub.Route(duet_pb2.RouteRequest(
                    prompt_tokens=100, max_tokens=50,
                    exclude_decode_instances=[d0, c.publishers["d1"].info.instance_nonce]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_routing_survives_redis_outage(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(worker("p1", "prefill"))
            await c.add(worker("d1", "decode"))
            await c.wait_live("p1", "d1")
            redis_server.stop()
            await asyncio.sleep(1.5)  # past the TTL: entries would have expired in a live Redis
            assert c.server.watcher.redis_ok is False
            reply = await asyncio.wait_for(c.route(page_hashes=[1, 2, 3]), timeout=2)
            assert (reply.prefill.worker_id, reply.decode.worker_id) == ("p1", "d1")
            redis_server.start()
            ok = await c.server.watcher.wait_for(lambda w: w.redis_ok and w.is_live("p1") and w.is_live("d1"), 5)
            assert ok

    asyncio.run(scenario())


def test_a_redis_restarted_empty_gives_prefix_routing_back_before_the_next_scan(redis_server):
    """Redis restarted empty: the workers publish their entries and page sets again at their next
    heartbeat, and routes find those pages at once, not only once the router's registry scan
    (30 s here) has noticed that Redis answers again."""
    async def scenario():
        prompt = list(range(2000, 2000 + 10 * PAGE))
        hashes = chained_page_hashes(prompt, PAGE)
        slow_scan = dataclasses.replace(registry(redis_server.url), scan_interval_s=30.0)
        async with Cluster(redis_server.url, registry_config=slow_scan) as c:
            await c.add(worker("p1", "prefill"), hashes=hashes)
            await c.add(worker("p2", "prefill"))
            await c.add(worker("d1", "decode"))
            await c.wait_live("p1", "p2", "d1")
            redis_server.stop()
            assert not await c.server.watcher.refresh()  # the scan that finds it down
            redis_server.start()
            client = redis.asyncio.Redis.from_url(redis_server.url)
            try:
                for _ in range(50):  # the heartbeat (0.2 s) that finds its entry gone re-registers in full
                    if await client.exists("duet:worker:p1:pages"):
                        break
                    await asyncio.sleep(0.1)
            finally:
                await client.aclose()
            reply = await c.route(prompt_tokens=len(prompt), page_hashes=hashes)
            assert reply.prefill.worker_id == "p1" and reply.cached_tokens == len(prompt) - 1

    asyncio.run(scenario())


def pools(tp: int, heads_per_rank: int, replicated: bool = False, head_bytes: int = 1024):
    from shared.registry.worker_info import RankKvPool
    return [RankKvPool(rank=r, agent_name=f"a{r}", base_addr=4096, page_bytes=4 * heads_per_rank * head_bytes,
                       num_pages=100, blocks=4, num_heads=heads_per_rank,
                       first_head=0 if replicated else r * heads_per_rank) for r in range(tp)]


def test_pairs_across_tp_sizes_and_says_why_a_pair_is_refused(redis_server):
    """Prefill TP 2 (one KV head per rank) pairs with decode TP 1 (both heads): same layout
    key, heads covered. A decode whose KV layout differs, or whose heads no prefill rank
    holds, is never chosen, and when nothing pairs the error names the pair and the reason."""
    async def scenario():
        async with Cluster(redis_server.url) as c:
            p2 = worker("p-tp2", "prefill", compat="m-L2-H2")
            p2.tp, p2.kv_layout, p2.kv_pools = 2, "L2-H2-P16-D64-bfloat16", pools(2, 1)
            odd = worker("d-other", "decode", compat="m-L2-H2-P32")
            odd.kv_layout, odd.kv_pools = "L2-H2-P32-D64-bfloat16", pools(1, 2)
            await c.add(p2)
            await c.add(odd)
            await c.wait_live("p-tp2", "d-other")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.route()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "p-tp2 -> d-other: KV layouts differ: prefill L2-H2-P16-D64-bfloat16 (tp 2), " \
                   "decode L2-H2-P32-D64-bfloat16 (tp 1)" in err.value.details()
            # same layout key but a rank layout whose heads the prefill ranks do not cover
            # (a prefill worker that published only its rank 0): refused with the head named
            half = worker("p-half", "prefill", compat="m-L2-H2")
            half.tp, half.kv_pools = 2, pools(2, 1)[:1]
            d1 = worker("d-tp1", "decode", compat="m-L2-H2")
            d1.kv_pools = pools(1, 2)
            from shared.registry.pairing import pair_problem
            assert "KV head 1, which no prefill rank holds" in pair_problem(half, d1)
            assert pair_problem(p2, d1) == ""
            await c.add(d1)
            await c.wait_live("d-tp1")
            replies = [await c.route() for _ in range(3)]
            assert {(r.prefill.worker_id, r.decode.worker_id) for r in replies} == {("p-tp2", "d-tp1")}

    asyncio.run(scenario())


def test_decode_pairing_weighs_held_tokens_not_just_share():
    """A decode worker holding a short prompt's shared head (the chat template) does not
    take every request from a less loaded one; one holding a long conversation keeps it."""
    from services.router.config import RoutingWeights
    from services.router.inflight import WorkerInflight
    from services.router.policy import choose_decode

    weights = RoutingWeights()
    busy = worker("d1", "decode", running_requests=8, free_pages=900)
    idle = worker("d2", "decode")

    def pick(prompt_tokens: int, held_pages: int) -> str:
        choice = choose_decode([busy, idle], prompt_tokens=prompt_tokens, max_tokens=16,
                               inflight={"d1": WorkerInflight(decode_requests=8)}, weights=weights,
                               cached_pages={"d1": held_pages})
        return choice.worker.worker_id

    # 40-token prompt, d1 holds its first 32 (the template): load decides
    assert pick(40, 32 // PAGE) == "d2"
    # 6000-token conversation, d1 holds all but the last turn: the held KV decides
    assert pick(6000, 5800 // PAGE) == "d1"


def test_lora_requests_go_to_workers_serving_the_adapter_preferring_those_holding_it(redis_server):
    """Only workers publishing the adapter are candidates (others are never chosen, and an
    adapter nobody serves is UNAVAILABLE naming it); among them the one holding it in a device
    slot wins over an equally loaded one that would have to load it first."""
    from shared.registry.worker_info import WorkerAdapters

    def with_adapters(info: WorkerInfo, served=(), resident=()) -> WorkerInfo:
        info.adapters = WorkerAdapters(list(served), list(resident))
        return info

    async def route(c, adapter: str):
        return await c.stub.Route(duet_pb2.RouteRequest(prompt_tokens=100, max_tokens=50, lora_adapter=adapter))

    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(with_adapters(worker("p1", "prefill"), ["x", "y"], ["y"]))
            await c.add(with_adapters(worker("p2", "prefill"), ["x", "y"], ["x"]))
            await c.add(with_adapters(worker("d1", "decode"), ["x"], []))
            await c.add(with_adapters(worker("d2", "decode"), ["x", "y"], ["x"]))
            await c.add(worker("d3", "decode"))
            await c.wait_live("p1", "p2", "d1", "d2", "d3")
            for _ in range(4):  # released at once: each routes against the same loads
                x = await route(c, "x")
                assert (x.prefill.worker_id, x.decode.worker_id) == ("p2", "d2")
                await c.stub.Release(duet_pb2.ReleaseRequest(request_id=x.request_id))
            y = await route(c, "y")
            assert y.decode.worker_id == "d2" and y.prefill.worker_id == "p1"
            base = {(await route(c, "")).decode.worker_id for _ in range(9)}
            assert "d3" in base  # the base model goes anywhere
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await route(c, "nobody-has-it")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "'nobody-has-it'" in info.value.details()

    asyncio.run(scenario())
