"""Where a prefill runs, by predicted latency (services/router/placement.py): the decision
flips from the decode worker to a prefill worker as the decode worker's batch grows, where the
threshold rule (policy.local_prefill_reason) keeps it local whatever the load. First on the
policy's own inputs, then through the router's gRPC service over a real Redis registry."""
from __future__ import annotations

import asyncio
import re

from protos import duet_pb2
from services.router.config import RoutingWeights
from services.router.inflight import WorkerInflight
from services.router.placement import place
from services.router.policy import DecodeChoice, PrefillChoice, local_prefill_reason
from shared.perf_model.step_model import StepModel
from shared.perf_model.transfer_model import TransferModel
from shared.perf_model.worker_perf import WorkerPerf
from shared.registry.prefix_hashes import chained_page_hashes
from shared.registry.worker_info import RankKvPool, WorkerInfo, WorkerLoad
from tests.disagg.test_router import Cluster
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

PAGE = 16
# an 8B-shaped GPU worker: 8 ms a step, 40 us a prefill token, 60 us a decode row, KV reads
MODEL = StepModel.from_dict({"base_s": 0.008, "prefill_token_s": 4e-5, "attended_pair_s": 2e-10,
                             "decode_row_s": 6e-5, "context_token_s": 3e-8})
PERF = WorkerPerf(MODEL, TransferModel(0.002, 20e9), itl_target_s=0.030, budget_floor_tokens=32)
PROMPT = 10_000                      # a conversation's next turn ...
HELD = PROMPT - 304                  # ... of which the decode worker holds 97%
KV_POOL = [RankKvPool(rank=0, agent_name="a0", base_addr=4096, page_bytes=PAGE * 131072, num_pages=1000)]


def worker(worker_id: str, role: str, rows: int = 0, context_per_row: int = 3000, **load) -> WorkerInfo:
    load = {"free_pages": 100_000, "total_pages": 100_000, "running_requests": rows,
            "decode_context_tokens": rows * context_per_row, **load}
    return WorkerInfo(worker_id=worker_id, role=role, address=f"{worker_id}.svc:7000", model="tiny",
                      page_size=PAGE, compat_hash="c1", max_batched_tokens=8192, kv_pools=list(KV_POOL),
                      load=WorkerLoad(**load), perf=WorkerPerf(PERF.step, PERF.transfer, PERF.itl_target_s,
                                                               PERF.budget_floor_tokens))


def decide(rows: int, weights: RoutingWeights | None = None, prefill_queue: int = 0, **kw):
    weights = weights or RoutingWeights()
    d = worker("d1", "decode", rows=rows)
    p = worker("p1", "prefill", queued_prefill_tokens=prefill_queue)
    decode = DecodeChoice(d, pages=1, cost=0.0, cached_tokens=HELD)
    prefill = PrefillChoice(p, cached_tokens=9_000, uncached_tokens=PROMPT - 9_000, cost=0.0)
    inflight = {"d1": WorkerInflight(decode_requests=rows)}
    return place(decode, prefill, PROMPT, inflight=inflight, weights=weights, **kw), decode


def test_idle_decode_prefills_locally_a_busy_one_hands_the_prefill_off():
    idle, decode = decide(rows=0)
    assert (idle.kind, idle.code) == ("local_prefill", "lowest_ttft"), idle.detail
    by_kind = {o.kind: o for o in idle.options}
    assert by_kind["local_prefill"].ttft_s < by_kind["split"].ttft_s
    assert by_kind["local_prefill"].itl_impact_s == 0  # nothing running to slow down

    # 96 running streams: the 304 tokens go in small chunks beside them (the inter-token budget),
    # which takes longer than an idle prefill worker plus the handoff
    busy, _ = decide(rows=96)
    assert (busy.kind, busy.code) == ("split", "lowest_ttft"), busy.detail
    by_kind = {o.kind: o for o in busy.options}
    assert by_kind["local_prefill"].allowed and by_kind["local_prefill"].step_s <= 0.030
    assert by_kind["split"].ttft_s < by_kind["local_prefill"].ttft_s

    # 256 streams: decode's step passes the target on its own; local prefill is held back, even
    # when the prefill worker's queue makes the split slower
    full, _ = decide(rows=256)
    assert full.kind == "split" and not {o.kind: o for o in full.options}["local_prefill"].allowed, full.detail
    queued, _ = decide(rows=256, prefill_queue=60_000)
    assert (queued.kind, queued.code) == ("split", "itl_target"), queued.detail
    assert {o.kind: o for o in queued.options}["split"].ttft_s > {o.kind: o for o in queued.options}[
        "local_prefill"].ttft_s

    # today's rule (within --local-prefill-min-share / --local-prefill-max-tokens) says local every time
    for rows in (0, 96, 256):
        _, d = decide(rows)
        assert local_prefill_reason(d, PROMPT, RoutingWeights()), rows
    threshold = RoutingWeights(placement="threshold")
    assert {decide(rows, threshold)[0].kind for rows in (0, 96, 256)} == {"local_prefill"}


def test_predicted_local_ttft_grows_with_the_batch_and_the_reason_says_why():
    ttfts = [{o.kind: o for o in decide(rows)[0].options}["local_prefill"].ttft_s for rows in (0, 16, 64, 128, 192)]
    assert ttfts == sorted(ttfts)
    busy, _ = decide(rows=96)
    assert re.search(r"predicted TTFT split [\d.]+ ms, local_prefill [\d.]+ ms", busy.detail), busy.detail
    assert "inter-token target 30 ms" in busy.detail
    # the router's target overrides the worker's: a lax target keeps local allowed at 256 rows
    lax, _ = decide(rows=256, target_s=0.200)
    assert {o.kind: o for o in lax.options}["local_prefill"].allowed


def test_bounds_and_missing_models():
    # beyond --local-prefill-max-tokens: never local, whatever the prediction
    out, _ = decide(rows=0, weights=RoutingWeights(local_prefill_max_tokens=256))
    assert (out.kind, out.code) == ("split", "bounds")
    # a worker that has published no model yet: today's rule
    d = worker("d1", "decode")
    d.perf = WorkerPerf()
    p = worker("p1", "prefill")
    out = place(DecodeChoice(d, 1, 0.0, HELD), PrefillChoice(p, 0, PROMPT, 0.0), PROMPT, inflight={},
                weights=RoutingWeights())
    assert (out.kind, out.code) == ("local_prefill", "no_model")


def test_a_prompt_the_saturated_split_would_keep_waiting_overflows_to_the_decode_worker():
    """An uncached 4096-token prompt, beyond the local-prefill bounds. With the prefill worker's
    queue past the first-token target (1 s) and a decode worker at 32 rows with time to spare,
    the decode worker prefills it itself (`overflow`); not while the prefill worker keeps up,
    not where the prefill already queued on the decode worker would stretch its rows' mean step
    past the inter-token target, and never where the workers publish no first-token target or the
    router runs without --placement-overflow."""
    def overflow(prefill_queue: int, decode_queue: int = 0, ttft_target_s: float = 1.0, on: bool = True):
        d = worker("d1", "decode", rows=32, queued_prefill_tokens=decode_queue)
        d.perf.ttft_target_s = ttft_target_s
        p = worker("p1", "prefill", queued_prefill_tokens=prefill_queue)
        inflight = {"d1": WorkerInflight(decode_requests=32)}
        return place(DecodeChoice(d, pages=1, cost=0.0, cached_tokens=0), PrefillChoice(p, 0, 4096, 0.0), 4096,
                     inflight=inflight, weights=RoutingWeights(overflow=on))

    assert overflow(prefill_queue=0).code == "bounds"  # the split meets the target: today's bounds rule
    # a prompt long enough to miss a tight target on an idle prefill worker is no queue to relieve
    alone = overflow(prefill_queue=0, ttft_target_s=0.05)
    assert alone.code == "bounds" and alone.chosen.ttft_s > 0.05, alone.detail
    saturated = overflow(prefill_queue=60_000)
    assert (saturated.kind, saturated.code) == ("local_prefill", "overflow"), saturated.detail
    by_kind = {o.kind: o for o in saturated.options}
    assert by_kind["split"].ttft_s > 1.0 > by_kind["local_prefill"].ttft_s
    assert saturated.detail.startswith("overflow: the split misses the first-token target; decode d1 prefills 4096")
    # 20k tokens already queued on the decode worker: 0.96 s of prefill in the 1 s span, its rows'
    # mean step would pass 30 ms
    crowded = overflow(prefill_queue=60_000, decode_queue=20_000)
    assert (crowded.kind, crowded.code) == ("split", "bounds"), crowded.detail
    assert overflow(prefill_queue=60_000, ttft_target_s=0.0).kind == "split"
    assert overflow(prefill_queue=60_000, on=False).code == "bounds"  # off by default (--placement-overflow)


def test_prompts_held_back_at_the_gateway_count_as_the_prefill_workers_backlog():
    """The gateway's admission lets only a couple of prefill steps' worth reach the workers, so a
    saturated prefill worker shows a short queue while the rest waits at the gateway: the route
    request carries those waiting prompt tokens, and with them the split is behind its target and
    the decode worker, which gives this prompt its first token within the target, takes it."""
    def route(backlog: int, prefill_queue: int = 4_000, ttft_target_s: float = 1.0):
        d = worker("d1", "decode", rows=32)
        d.perf.ttft_target_s = ttft_target_s
        p = worker("p1", "prefill", queued_prefill_tokens=prefill_queue)
        return place(DecodeChoice(d, pages=1, cost=0.0, cached_tokens=0), PrefillChoice(p, 0, 4096, 0.0), 4096,
                     inflight={"d1": WorkerInflight(decode_requests=32)}, weights=RoutingWeights(overflow=True),
                     backlog_tokens=backlog)

    keeping_up = route(backlog=0)
    assert keeping_up.code == "bounds", keeping_up.detail  # P's own queue is within the target
    by_kind = {o.kind: o for o in keeping_up.options}
    assert by_kind["split"].ttft_s < 1.0
    behind = route(backlog=60_000)
    assert (behind.kind, behind.code) == ("local_prefill", "overflow"), behind.detail
    assert "(60000 prompt tokens waiting at the gateway)" in behind.detail
    assert {o.kind: o for o in behind.options}["local_prefill"].ttft_s <= 1.0
    assert route(backlog=3_000).code == "bounds"  # a backlog P clears within the target
    # all of it at the gateway and P idle: P gives this prompt its first token sooner, so it goes
    # there (lowest TTFT among the options, overflow one of them); the next one finds P's queue
    idle = route(backlog=60_000, prefill_queue=0)
    assert (idle.kind, idle.code) == ("split", "lowest_ttft") and "local_prefill" in idle.detail, idle.detail


def test_a_both_worker_is_a_third_option():
    b = worker("b1", "both")
    out, _ = decide(rows=256, colocated=PrefillChoice(b, cached_tokens=HELD, uncached_tokens=PROMPT - HELD,
                                                       cost=0.0))
    assert out.kind == "colocated", out.detail  # idle, holds the prompt: fastest, no transfer


def test_router_flips_as_the_decode_worker_reports_its_batch(redis_server):
    """The same conversation turn through the router's gRPC service, the decode worker's load
    and model published by WorkerPublisher into a real Redis."""
    prompt = list(range(3000, 3000 + PROMPT))
    hashes = chained_page_hashes(prompt, PAGE)

    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(worker("p1", "prefill"), hashes=hashes[:9_000 // PAGE])
            pub = await c.add(worker("d1", "decode"), hashes=hashes[:HELD // PAGE])
            await c.wait_live("p1", "d1")
            idle = await c.route(prompt_tokens=PROMPT, page_hashes=hashes, request_id="t-idle")
            assert idle.local_prefill and idle.decode.worker_id == "d1", idle.reason
            await c.stub.Release(duet_pb2.ReleaseRequest(request_id="t-idle"))
            pub.set_load(WorkerLoad(free_pages=100_000, total_pages=100_000, running_requests=256,
                                    decode_context_tokens=256 * 3000))
            assert await c.server.watcher.wait_for(lambda w: w.get("d1").load.running_requests == 256, 3)
            busy = await c.route(prompt_tokens=PROMPT, page_hashes=hashes, request_id="t-busy")
            assert not busy.colocated and busy.prefill.worker_id == "p1", busy.reason
            assert "over the target" in busy.reason
            value = c.server.metrics.registry.get_sample_value
            assert value("duet_router_decisions_total", {"kind": "local_prefill", "reason": "lowest_ttft", "model": "tiny"}) == 1
            assert value("duet_router_decisions_total", {"kind": "split", "reason": "lowest_ttft", "model": "tiny"}) == 1
            assert value("duet_router_predicted_ttft_seconds_count", {"kind": "split"}) == 1

    asyncio.run(scenario())


def test_predictions_within_the_models_error_are_a_tie_won_by_local_prefill():
    """Two workers of one kind, their models fitted apart: local prefill predicted a few per
    cent slower than the split is noise when the models are only 20% right."""
    def slow(model: StepModel, by: float, error: float) -> StepModel:
        return StepModel(tuple(c * by for c in model.coef), 100, error)
    d = worker("d1", "decode")
    p = worker("p1", "prefill")
    decode = DecodeChoice(d, pages=1, cost=0.0, cached_tokens=PROMPT - 32)
    prefill = PrefillChoice(p, cached_tokens=PROMPT - 48, uncached_tokens=48, cost=0.0)
    for error, kind in ((0.0, "split"), (0.2, "local_prefill")):
        d.perf.step, p.perf.step = slow(MODEL, 1.4, error), slow(MODEL, 1.0, error)
        out = place(decode, prefill, PROMPT, inflight={}, weights=RoutingWeights())
        by_kind = {o.kind: o for o in out.options}
        assert by_kind["split"].ttft_s < by_kind["local_prefill"].ttft_s < by_kind["split"].ttft_s * 1.2
        assert out.kind == kind, out.detail


def test_the_router_weighs_the_prompts_waiting_at_the_gateway(redis_server):
    """Through the router's gRPC service with --placement-overflow: an uncached 4096-token prompt
    with a short queue on the prefill worker goes split; the same with 60k prompt tokens waiting
    in the sending gateway's admission (RouteRequest.admission_waiting_tokens) overflows to the
    decode worker, and the decision is counted as `overflow`."""
    async def scenario():
        async with Cluster(redis_server.url) as c:
            c.server.config.weights.overflow = True
            p = worker("p1", "prefill", queued_prefill_tokens=4_000)
            d = worker("d1", "decode", rows=32)
            d.perf.ttft_target_s = 1.0
            await c.add(p)
            await c.add(d)
            await c.wait_live("p1", "d1")

            async def route(rid: str, waiting: int, gateway: str = ""):
                reply = await c.stub.Route(duet_pb2.RouteRequest(request_id=rid, prompt_tokens=4096, max_tokens=64,
                                                                 admission_waiting_tokens=waiting, gateway_id=gateway))
                await c.stub.Release(duet_pb2.ReleaseRequest(request_id=rid))
                return reply
            kept = await route("t-kept", 0)
            assert not kept.colocated and kept.prefill.worker_id == "p1", kept.reason
            moved = await route("t-moved", 60_000)
            assert moved.local_prefill and moved.decode.worker_id == "d1", moved.reason
            assert "60000 prompt tokens waiting at the gateway" in moved.reason
            value = c.server.metrics.registry.get_sample_value
            assert value("duet_router_decisions_total", {"kind": "local_prefill", "reason": "overflow",
                                                         "model": "tiny"}) == 1
            # two gateway processes, 10k waiting in each: one's figure alone keeps the split, both count
            alone = await route("t-one-gateway", 10000, "gw-a")
            assert not alone.colocated, alone.reason
            both = await route("t-two-gateways", 10000, "gw-b")
            assert both.local_prefill and "20000 prompt tokens waiting at the gateway" in both.reason, both.reason

    asyncio.run(scenario())


def test_the_split_is_predicted_by_the_prefill_workers_model_of_prompts_alone():
    """A switchable worker turned prefill may carry a whole model fitted to its mixed steps as
    `both`; its published model of steps with prompts alone (perf_prefill_step) prices the split."""
    from dataclasses import replace

    from pytest import approx

    weights = RoutingWeights()
    d, p = worker("d1", "decode", rows=96), worker("p1", "prefill")
    alone = StepModel.from_dict({**MODEL.to_dict(), "prefill_token_s": 1e-5})  # a quarter of the whole model's
    p_alone = replace(p, perf=replace(p.perf, prefill_step=alone))
    decode = DecodeChoice(d, pages=1, cost=0.0, cached_tokens=HELD)
    inflight = {"d1": WorkerInflight(decode_requests=96)}

    def split_ttft(prefill_worker):
        choice = PrefillChoice(prefill_worker, cached_tokens=0, uncached_tokens=PROMPT, cost=0.0)
        placed = place(decode, choice, PROMPT, inflight=inflight, weights=weights)
        return {o.kind: o for o in placed.options}["split"].ttft_s

    whole, by_alone = split_ttft(p), split_ttft(p_alone)
    assert by_alone < whole / 2
    # the prefill itself, by each model, is what the two predictions differ by (the handoff is the same)
    assert whole - by_alone == approx((4e-5 - 1e-5) * PROMPT, rel=0.05)
