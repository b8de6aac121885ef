"""The router's own account of routed requests (services/router/inflight.py) forgets a Route
that is never released after `--inflight-ttl`: phantom routes (a client that only calls
Route, a gateway that died) cannot pin load on a worker. Through a real router over gRPC
with a real Redis registry, and the tracker's expiry at given instants."""
from __future__ import annotations

import asyncio

from services.router.config import RouterConfig
from services.router.inflight import InflightTracker, RoutedRequest
from tests.disagg.test_router import Cluster, worker
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)


def test_an_unreleased_route_expires_after_the_ttl():
    t = InflightTracker(ttl_s=60.0)
    for i in range(3):
        t.add(RoutedRequest(f"r{i}", "p1", 100, "d1", 10, created=1000.0 + i))
    t.release("r1", prefill_only=False)
    assert t.expire({"p1", "d1"}, now=1060.0) == 0  # r0 is exactly 60 s old: kept
    assert t.per_worker()["d1"].decode_requests == 2
    assert t.expire({"p1", "d1"}, now=1061.5) == 1  # r0 gone; r2 (created 1002) stays
    loads = t.per_worker()
    assert (loads["p1"].prefill_requests, loads["d1"].decode_requests, loads["d1"].decode_pages) == (1, 1, 10)
    assert t.expire({"p1", "d1"}, now=1062.5) == 1
    # nothing routed counts any more (r1's release is still remembered for the load report's age)
    assert all((w.prefill_requests, w.decode_requests) == (0, 0) for w in t.per_worker().values())


def test_the_setting_has_a_short_default_and_reaches_the_router():
    assert RouterConfig().inflight_ttl_s == 60.0
    assert RouterConfig.from_argv(["--inflight-ttl", "5"]).inflight_ttl_s == 5.0
    assert RouterConfig.from_argv([], env={"DUET_ROUTER_INFLIGHT_TTL": "7"}).inflight_ttl_s == 7.0


def test_phantom_routes_stop_counting_after_the_ttl(redis_server):
    async def scenario():
        async with Cluster(redis_server.url) as c:
            for role in ("prefill", "decode"):  # one pair: every route loads d1
                await c.add(worker(f"{role[0]}1", role))
            await c.wait_live("p1", "d1")
            for i in range(200):  # routed, never released
                await c.route(request_id=f"phantom-{i}")
            loads = c.server.service.inflight.per_worker()
            assert loads["d1"].decode_requests == 200 and len(c.server.service.inflight) == 200
            c.server.service.inflight.ttl_s = 0.5  # as --inflight-ttl 0.5 would have it
            await asyncio.sleep(0.6)
            assert len(c.server.service.inflight) == 0  # the gauge no longer counts them
            await c.route(request_id="real")  # the next Route drops them
            assert c.server.service.inflight.per_worker()["d1"].decode_requests == 1

    asyncio.run(scenario())
