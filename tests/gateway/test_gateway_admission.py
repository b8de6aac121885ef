"""Admission by work (services/gateway/http_edge/admission.py): units of sequences and KV
tokens against a budget, fair turns across API keys (or requests), a per-request bound on
running sequences, and "can never fit a live worker" refused with a 400 before anything is
sent. The queue is driven directly for its decisions, and through a real uvicorn server
with a ScriptedBackend (slow tokens) for the HTTP behaviour: a prompt list cannot starve
another client's one-token request."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.gateway.backends.capacity import WorkerCapacity
from services.gateway.http_edge.admission import AdmissionQueue, AdmissionRefused, Budget, Work
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.openai_schema import validate
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir, wait_until

MODEL = "tiny"
CONTEXT = 256


# --- the queue's decisions -----------------------------------------------------------------


def test_units_weigh_sequences_and_tokens_against_the_budget():
    async def fair_line():
        q = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=8, tokens=1000))
        a = await q.ticket().acquire(Work(6, 100))
        b = asyncio.create_task(q.ticket().acquire(Work(4, 100)))  # 6 + 4 > 8 sequences: waits
        await asyncio.sleep(0.01)
        assert not b.done() and (q.queued, q.running.sequences, q.waiting_sequences) == (1, 6, 4)
        c = asyncio.create_task(q.ticket().acquire(Work(2, 100)))  # fits: it passes b, which does not yet
        await asyncio.sleep(0.01)
        assert not b.done() and c.done()
        a.release()  # 2 + 4 fit now
        await asyncio.wait_for(b, 1)
        assert (q.running.sequences, q.running.tokens) == (6, 200)
        tokens = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=100, tokens=300))
        x = await tokens.ticket().acquire(Work(1, 250))
        y = asyncio.create_task(tokens.ticket().acquire(Work(1, 100)))  # 350 tokens > 300: waits
        await asyncio.sleep(0.01)
        assert not y.done()
        x.release()
        await asyncio.wait_for(y, 1)
        alone = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=4, tokens=10))
        big = await asyncio.wait_for(alone.ticket().acquire(Work(128, 10_000)), 1)  # alone, anything runs
        big.release()
    asyncio.run(fair_line())


def test_a_unit_that_fits_passes_a_bigger_one_until_that_one_has_aged():
    """A long prompt waiting for the prefill budget does not hold up a short one behind it;
    once it has waited `aging_s`, nobody passes it and the budget drains for it."""
    async def go():
        clock = [0.0]
        q = AdmissionQueue(10, 10, 0, budget=lambda pool: Budget(sequences=100, prefill_tokens=100), aging_s=5.0,
                           clock=lambda: clock[0])
        running = await q.ticket().acquire(Work(1, 60, 60))
        big = asyncio.create_task(q.ticket().acquire(Work(1, 500, 500)))  # 60 + 500 > 100: waits
        await asyncio.sleep(0.01)
        small = await asyncio.wait_for(q.ticket().acquire(Work(1, 20, 20)), 1)  # fits: passes the big one
        assert not big.done() and q.running.prefill_tokens == 80
        small.prefilled()
        clock[0] = 5.0  # the big one has waited its aging time
        later = asyncio.create_task(q.ticket().acquire(Work(1, 20, 20)))  # would fit, but may not pass now
        await asyncio.sleep(0.01)
        assert not later.done() and not big.done()
        running.prefilled()  # nothing prefilling: the big prompt runs (a unit alone always does); the
        await asyncio.wait_for(asyncio.gather(big, later), 1)  # small one then gets its share of the budget
        assert q.running.prefill_tokens == 520
        for grant in (running, small, big.result(), later.result()):
            grant.release()
        assert (q.running.sequences, q.running.prefill_tokens) == (0, 0)
    asyncio.run(go())


def test_each_model_is_admitted_against_its_own_workers_budget():
    """Two models, each with workers of its own: one key's prompts of model `big` fill big's
    prefill budget and its aged prompt holds big's room, yet the same key's prompt of `small`
    goes at once (small's workers are idle), and each pool frees alone."""
    async def go():
        clock = [0.0]
        asked = []

        def budget(pool: str) -> Budget:
            asked.append(pool)
            return Budget(sequences=100, prefill_tokens={"big": 100, "small": 40}[pool])

        q = AdmissionQueue(10, 10, 0, budget=budget, aging_s=5.0, clock=lambda: clock[0],
                           pools=lambda: ["big", "small"])
        key = q.ticket("key")
        bulk = [await key.acquire(Work(1, 50, 50, pool="big")), await key.acquire_more(Work(1, 50, 50, pool="big"))]
        aged = asyncio.create_task(q.ticket("key").acquire(Work(1, 80, 80, pool="big")))
        await asyncio.sleep(0.01)
        clock[0] = 10.0  # big's waiting prompt has aged: big's freed room is its
        assert not aged.done() and q.waiting_prompt_tokens_of("big") == 80 and q.waiting_prompt_tokens_of("small") == 0
        small = await asyncio.wait_for(q.ticket("key").acquire(Work(1, 30, 30, pool="small")), 1)
        other = asyncio.create_task(q.ticket("key").acquire(Work(1, 30, 30, pool="small")))  # 60 > small's 40
        await asyncio.sleep(0.01)
        assert not other.done() and (q.running.prefill_tokens, q.budget_total().prefill_tokens) == (130, 140)
        small.prefilled()  # small's room frees small's prompt, not big's
        await asyncio.wait_for(other, 1)
        assert not aged.done()
        for g in bulk:
            g.prefilled()
        await asyncio.wait_for(aged, 1)
        assert {"big", "small"} <= set(asked)
        for g in bulk + [small, other.result(), aged.result()]:
            g.release()
        key.release()
        assert q.running == type(q.running)() and all(not p.tenants for p in q._pools.values())
    asyncio.run(go())


def test_a_full_prefill_budget_still_lets_each_tenant_its_share():
    """A prompt list fills the prefill budget; another client's short prompt is owed its
    share of it (the budget over the tenants with work) and goes at once; the list's next
    prompt and a newcomer's prompt longer than its share wait for room."""
    async def go():
        q = AdmissionQueue(10, 10, 0, budget=lambda pool: Budget(sequences=100, prefill_tokens=100))
        bulk = q.ticket("bulk")
        grants = [await bulk.acquire(Work(1, 12, 10))]
        grants += [await bulk.acquire_more(Work(1, 12, 10)) for _ in range(9)]
        assert q.running.prefill_tokens == 100
        more = asyncio.create_task(bulk.acquire_more(Work(1, 12, 10)))
        await asyncio.sleep(0.01)
        assert not more.done()
        victim = await asyncio.wait_for(q.ticket("victim").acquire(Work(1, 11, 10)), 1)  # its share: 50
        assert q.running.prefill_tokens == 110
        long = asyncio.create_task(q.ticket("long").acquire(Work(1, 50, 40)))  # its share: 33
        await asyncio.sleep(0.01)
        assert not long.done() and not more.done()
        for g in grants:  # the list's prompts reach their first token: room for both
            g.prefilled()
        await asyncio.wait_for(asyncio.gather(long, more), 1)
        for g in grants + [victim, long.result(), more.result()]:
            g.release()
        bulk.release()
        assert (q.running.sequences, q.running.prefill_tokens, q._pool("").tenants) == (0, 0, {})
    asyncio.run(go())


def test_two_prompt_lists_leave_a_newcomer_a_place_in_the_batch():
    """The last sixteenth of the sequence budget is for tenants below their share counting
    one more: two lists stop at 30 of 32 sequences, and a third client's request runs at once
    instead of waiting for a list's sequence to finish."""
    async def go():
        q = AdmissionQueue(10, 10, 0, budget=lambda pool: Budget(sequences=32))
        lists, waiting = [q.ticket(k) for k in ("list-a", "list-b")], []
        for t in lists:
            await t.acquire(Work(1, 10))
        for _ in range(40):  # both lists' other prompts, sent together: they take turns
            waiting += [asyncio.create_task(t.acquire_more(Work(1, 10))) for t in lists]
        await asyncio.sleep(0.01)
        assert q.running.sequences == 30 and sum(w.done() for w in waiting) == 28
        victim = await asyncio.wait_for(q.ticket("victim").acquire(Work(1, 10)), 1)
        assert q.running.sequences == 31
        victim.release()
        for t in lists:
            t.release()
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert (q.running.sequences, q._pool("").tenants) == (0, {})
    asyncio.run(go())


def test_prompt_tokens_count_until_their_first_token():
    """The prefill budget: a unit's prompt counts from its grant to its first token, so the
    prefill workers' queue stays a couple of steps long and the order is decided here."""
    async def go():
        q = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=100, prefill_tokens=100))
        a = await q.ticket().acquire(Work(1, 90, 80))
        # 80 + 60 > 100 prompt tokens, and 60 is more than b's half of the budget
        b = asyncio.create_task(q.ticket().acquire(Work(1, 70, 60)))
        await asyncio.sleep(0.01)
        assert not b.done() and q.running.prefill_tokens == 80
        a.prefilled()  # a's first token: its prompt is done, its sequence still runs
        b_grant = await asyncio.wait_for(b, 1)
        assert (q.running.sequences, q.running.prefill_tokens) == (2, 60)
        a.prefilled()  # idempotent
        a.release()
        b_grant.release()  # never prefilled (it failed first): its prompt tokens go back too
        assert (q.running.sequences, q.running.tokens, q.running.prefill_tokens) == (0, 0, 0)
        huge = await asyncio.wait_for(q.ticket().acquire(Work(1, 10, 5000)), 1)  # alone, any prompt runs
        huge.release()
    asyncio.run(go())


def test_a_routed_prompt_keeps_only_its_uncached_tokens_on_the_prefill_budget():
    """A later chat turn is mostly cached on the worker the router picks: once routed, only the
    rest is prefill work, so the next prompts reach the workers at once instead of two or three
    whole contexts at a time."""
    async def go():
        q = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=100, prefill_tokens=10_000))
        turns = [q.ticket("chat") for _ in range(3)]
        a = await turns[0].acquire(Work(1, 6200, 6000))
        b = asyncio.create_task(turns[1].acquire(Work(1, 6200, 6000)))  # 12k > 10k: waits
        c = asyncio.create_task(turns[2].acquire(Work(1, 6200, 6000)))
        await asyncio.sleep(0.01)
        assert not b.done() and not c.done() and q.running.prefill_tokens == 6000
        a.routed(5800)  # the route: the chosen worker holds 5800 of the 6000
        b_grant = await asyncio.wait_for(b, 1)  # 200 + 6000 fit: b goes at once
        assert q.running.prefill_tokens == 6200 and q.cached_prompt_tokens == 5800 and not c.done()
        b_grant.routed(5900)
        c_grant = await asyncio.wait_for(c, 1)
        assert q.running.prefill_tokens == 200 + 100 + 6000
        a.routed(0)  # a moved attempt routed again, nothing cached there: the charge stays lowered
        a.routed(5800)  # the same count again: of the whole prompt, so nothing more comes off
        a.routed(6000)  # ... and only lowers: now nothing is left to prefill
        assert q.running.prefill_tokens == 100 + 6000 and q.cached_prompt_tokens == 5800 + 5900 + 200
        a.prefilled()
        c_grant.prefilled()
        c_grant.routed(6000)  # past its first token: nothing to take off
        assert q.running.prefill_tokens == 100 and q.cached_prompt_tokens == 11_900
        for grant, ticket in zip((a, b_grant, c_grant), turns):
            grant.release()
            ticket.release()
        assert (q.running.sequences, q.running.tokens, q.running.prefill_tokens) == (0, 0, 0)
        assert q._pool("").tenants == {}
    asyncio.run(go())


def test_a_prompt_a_decode_worker_prefills_leaves_the_prefill_budget_whole():
    """The router's local and overflow placements send a prompt to a decode worker, which prefills
    it beside its rows in inter-token-budgeted slices: outside the prefill workers whose prompts
    the budget bounds, so none of the prompt stays on it and the next prompt reaches the prefill
    worker at once (charged whole, an overflowed long prompt kept that much of the prefill
    worker's room idle while the decode worker worked through it). Moved on to a prefill worker
    (the decode worker lost before its first token), it is charged again for what that one lacks."""
    async def go():
        q = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=100, prefill_tokens=10_000))
        tickets = [q.ticket("k") for _ in range(4)]
        a = await tickets[0].acquire(Work(1, 4352, 4096))
        b = asyncio.create_task(tickets[1].acquire(Work(1, 4352, 4096)))
        c = asyncio.create_task(tickets[2].acquire(Work(1, 4352, 4096)))  # 12k > 10k: waits
        b_grant = await asyncio.wait_for(b, 1)
        await asyncio.sleep(0.01)
        assert not c.done() and q.running.prefill_tokens == 8192
        a.routed(1024, local_prefill=True)  # overflow: the decode worker prefills it (1024 it held)
        c_grant = await asyncio.wait_for(c, 1)
        assert q.running.prefill_tokens == 8192 and q.cached_prompt_tokens == 1024
        b_grant.routed(0)  # a split route, nothing cached: its whole prompt stays on the budget
        assert q.running.prefill_tokens == 8192
        a.routed(2048, local_prefill=True)  # routed again to a decode worker: nothing more to take off
        a.prefilled()  # its first token: what the decode worker prefilled is counted
        assert q.local_prefill_prompt_tokens == 3072 and q.running.prefill_tokens == 8192
        # d goes to a decode worker, which is lost before the first token; the moved attempt is split
        d = asyncio.create_task(tickets[3].acquire(Work(1, 4352, 4096)))
        await asyncio.sleep(0.01)
        assert not d.done()
        c_grant.routed(0, local_prefill=True)
        d_grant = await asyncio.wait_for(d, 1)
        assert q.running.prefill_tokens == 8192
        c_grant.routed(512)  # a prefill worker holding 512 of it: 3584 is its work again
        assert q.running.prefill_tokens == 8192 + 3584
        c_grant.routed(3000)  # a later word of more cached lowers it as before
        assert q.running.prefill_tokens == 8192 + 1096
        c_grant.prefilled()
        assert q.local_prefill_prompt_tokens == 3072  # c's prefill was not a decode worker's
        for grant, ticket in zip((a, b_grant, c_grant, d_grant), tickets):
            grant.release()
            ticket.release()
        assert (q.running.sequences, q.running.tokens, q.running.prefill_tokens) == (0, 0, 0)
        assert q._pool("").tenants == {}
    asyncio.run(go())


def test_fair_turns_across_api_keys_and_a_bound_per_request():
    async def go():
        q = AdmissionQueue(10, 10, 5.0, budget=lambda pool: Budget(sequences=4), max_request_share=0.75)
        big = q.ticket("key-a")
        grants = [await big.acquire(Work(1, 10))]
        more = [asyncio.create_task(big.acquire_more(Work(1, 10))) for _ in range(7)]
        await asyncio.sleep(0.01)
        assert sum(t.done() for t in more) == 2  # the request's own bound: 3 running of its 8
        assert q.running.sequences == 3 and q.waiting_sequences == 5
        victim_ticket, later_ticket = q.ticket("key-b"), q.ticket("key-b")
        victim = asyncio.create_task(victim_ticket.acquire(Work(1, 10)))
        await asyncio.sleep(0.01)
        assert victim.done()  # room in the budget (4), and key-b's share is 0
        grants += [t.result() for t in more if t.done()]
        # the budget is full now (4); key-a's waiting unit and a second key-b request queue
        later = asyncio.create_task(later_ticket.acquire(Work(1, 10)))
        await asyncio.sleep(0.01)
        grants[0].release()  # room for one: key-b holds 1 of 4, key-a 2: key-b goes first
        await asyncio.sleep(0.01)
        assert later.done() and sum(t.done() for t in more) == 2
        victim_ticket.release()  # the request ends: its grant goes back
        await asyncio.sleep(0.01)
        assert sum(t.done() for t in more) == 3  # then key-a's next prompt
        big.release()  # the request ends: its waiting prompts are cancelled by their tasks
        for t in more:
            t.cancel()
        await asyncio.gather(*more, return_exceptions=True)
        later_ticket.release()
        assert (q.active, q.places, q.queued, q.running.sequences, q.running.tokens, q.waiting_sequences) == \
            (0, 0, 0, 0, 0, 0)
        # one key, two requests: its small request does not wait behind its own prompt list
        same = q.ticket("key-c")
        await same.acquire(Work(1, 10))
        rest = [asyncio.create_task(same.acquire_more(Work(1, 10))) for _ in range(5)]
        other = q.ticket("key-d")
        await asyncio.sleep(0.01)
        await other.acquire(Work(1, 10))  # the budget's 4th sequence
        small = asyncio.create_task(q.ticket("key-c").acquire(Work(1, 10)))
        await asyncio.sleep(0.01)
        assert not small.done() and sum(t.done() for t in rest) == 2  # bound 3, budget 4: full
        next(t for t in rest if t.done()).result().release()
        await asyncio.sleep(0.01)
        assert small.done() and sum(t.done() for t in rest) == 2
        same.release()
        other.release()
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
    asyncio.run(go())


def test_no_place_is_refused_at_once_and_a_refused_ticket_holds_nothing():
    async def go():
        q = AdmissionQueue(1, 1, 0.05)
        a = q.ticket()
        await a.acquire()
        b = q.ticket()
        with pytest.raises(AdmissionRefused):  # waits 50 ms for the only slot
            await b.acquire()
        assert (q.places, q.active, q.queued, q.refused) == (1, 1, 0, 1)
        q.queue_timeout_s = 5.0
        waiting = asyncio.create_task(q.ticket().acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionRefused):  # both places taken: refused in the call, no wait
            q.ticket().hold_place()
        a.release()
        await waiting
    asyncio.run(go())


# --- over HTTP ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT))


def _server(prompts, limits: GatewayLimits, capacity=()):
    backend = ScriptedBackend(script=prompts.tokenizer.encode("slow words", add_special_tokens=False),
                              eos_token_id=prompts.tokenizer.eos_token_id, max_context_len=CONTEXT,
                              capacity=list(capacity))
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT, limits=limits)
    return backend, ctx, UvicornThread(build_app(ctx))


def test_a_prompt_list_cannot_starve_a_one_token_request(prompts):
    """12 prompts against a budget of 4 sequences (the live workers' batch capacity): at most
    4 run at once, and a one-token request that arrives while they run is served within a
    prompt's time, long before the list ends."""
    capacity = [WorkerCapacity("decode", 1000, 16, 4), WorkerCapacity("prefill", 1000, 16, 4)]
    backend, ctx, server = _server(prompts, GatewayLimits(max_request_share=1.0), capacity)
    backend.delay_s = 0.1  # ~11 tokens: a prompt runs ~1.1 s; the list 3 rounds of 4

    async def go(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            big = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": [f"prompt {i}" for i in range(12)], "max_tokens": 12}))
            await asyncio.to_thread(wait_until, lambda: ctx.admission.running.sequences == 4, 5)
            started = time.monotonic()
            small = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            small_s = time.monotonic() - started
            big = await big
            return big, small, small_s, time.monotonic() - started
    with server:
        big, small, small_s, big_s = asyncio.run(go(server.base_url))
    assert small.status_code == 200 and big.status_code == 200, (small.text, big.text)
    assert len(big.json()["choices"]) == 12
    assert backend.peak_running == 4  # never more than the budget
    # its turn came with the first free place, in the list's second round of 4 (first come,
    # first served it would follow all 12 prompts), so it took about one prompt's time
    order = [r.request_id.startswith(big.json()["id"]) for r in backend.requests]
    assert order.index(False) < 8, order
    assert small_s < big_s / 2, (small_s, big_s)
    assert (ctx.admission.active, ctx.admission.running.sequences, ctx.admission.waiting_sequences) == (0, 0, 0)


def test_what_can_never_fit_a_live_worker_is_a_400_before_anything_is_sent(prompts):
    capacity = [WorkerCapacity("decode", 8, 16, 4), WorkerCapacity("prefill", 8, 16, 4, 256)]  # 128 tokens
    backend, ctx, server = _server(prompts, GatewayLimits(), capacity)
    with server:
        url = server.base_url
        cases = [({"prompt": "hello", "max_tokens": 200}, "/v1/completions", "max_tokens"),
                 ({"prompt": ["a", "hello " * 20], "max_tokens": 100}, "/v1/completions", "max_tokens"),
                 ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20, "n": 8},
                  "/v1/chat/completions", "max_completion_tokens"),
                 ({"input": "hi", "max_output_tokens": 200}, "/v1/responses", "max_output_tokens")]
        for body, path, param in cases:
            r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=10)
            assert r.status_code == 400, r.text
            validate(r.json(), "ErrorResponse")
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "kv_capacity_exceeded"
        # at once: nothing reached the backend, not even the list's first prompt (no wall-clock
        # bound here: the suite shares two cores with another worker)
        assert backend.requests == []
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 100})
        assert ok.status_code == 200, ok.text  # 5 + 100 tokens: 7 pages of 8
    metrics = ctx.metrics.exposition().decode()
    for gauge in ("duet_gateway_running_sequences", "duet_gateway_waiting_sequences", "duet_gateway_running_tokens",
                  "duet_gateway_sequence_budget 4.0", "duet_gateway_token_budget 0.0",
                  "duet_gateway_prefilling_tokens 0.0", "duet_gateway_prefill_budget 512.0"):
        assert gauge in metrics, gauge


def test_several_gateways_each_admit_their_share_of_the_workers(prompts):
    """--gateways N (duet up: its --gateway-processes): the default budgets are this gateway's
    share of the live workers' capacity, rounded up; set limits stay as set."""
    capacity = [WorkerCapacity("decode", 64, 16, 5), WorkerCapacity("prefill", 64, 16, 4, 300)]
    budgets = {n: _server(prompts, GatewayLimits(gateways=n), capacity)[1].admission_budget() for n in (1, 2, 3)}
    assert [(b.sequences, b.prefill_tokens) for b in budgets.values()] == [(5, 600), (3, 300), (2, 200)]
    set_limits = GatewayLimits(gateways=2, max_running_sequences=7, max_prefill_tokens=100)
    budget = _server(prompts, set_limits, capacity)[1].admission_budget()
    assert (budget.sequences, budget.prefill_tokens) == (7, 100)
    with pytest.raises(ValueError, match="gateways must be >= 1"):
        GatewayLimits(gateways=0)
