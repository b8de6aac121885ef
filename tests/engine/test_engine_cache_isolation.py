"""Prefix-cache isolation and per-tenant KV quotas in the engine.

A request matches only the pages inserted under its own cache namespace, and the page hashes
the tree publishes are seeded with the namespace; a tenant's flood evicts its own cached pages
before another tenant's conversation (`cache_share`), and a tenant whose live work holds its
share of the pool lets another tenant's waiting request go first (`live_share`). Per-tenant
page counts go back to zero when the work ends (check_idle). Tokens are compared with the
same engine's answers (float64 on the CPU)."""
from __future__ import annotations

import pytest

from shared.engine.cache_scope import CacheScope
from shared.engine.engine import Engine
from shared.engine.kv_pool import PageAllocator
from shared.engine.radix_cache import RadixCache
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.tenant_quota import TenantQuota
from shared.registry.kv_events import KvEventBuffer
from shared.registry.prefix_hashes import chained_page_hashes
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, kv_bytes_for_pages, random_prompts

KIND = "qwen2_untied_bias"
PS = 4
A = CacheScope(namespace=0x1111, tenant=1)
A_SALTED = CacheScope(namespace=0x2222, tenant=1)  # the same tenant with a cache_salt
B = CacheScope(namespace=0x3333, tenant=2)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("isolation") / KIND, KIND, seed=7)


def make_engine(d, pages: int = 64, **kw) -> Engine:
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=PS, max_num_batched_tokens=16,
                kv_cache_memory=kv_bytes_for_pages(d, pages + 1, PS))  # + the padding page
    opts.update(kw)
    return Engine(**opts)


def serve(eng: Engine, prompt: list[int], scope: CacheScope, max_tokens: int = 4) -> tuple[list[int], int]:
    """One request to its end: (tokens, prompt tokens it found cached)."""
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), scope=scope)
    tokens, cached = [], None
    while eng.has_work:
        for out in eng.step():
            assert out.rid == rid
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return tokens, cached


# -- the tree on its own -------------------------------------------------------------------------
def test_the_same_tokens_in_two_namespaces_share_no_page_and_publish_their_own_hashes():
    alloc = PageAllocator(16)
    events = KvEventBuffer()
    cache = RadixCache(alloc, PS, events=events)
    tokens = list(range(1, 3 * PS + 1))
    a_pages = alloc.allocate(3)
    assert cache.insert(tokens, a_pages, A) == ([], cache.match(tokens, A.namespace).node)
    assert cache.match(tokens, A.namespace).pages == a_pages
    assert cache.match(tokens, B.namespace).pages == [] and cache.match(tokens).pages == []
    b_pages = alloc.allocate(3)
    dups, _ = cache.insert(tokens, b_pages, B)  # nothing of A's is taken for B's own
    assert dups == [] and cache.match(tokens, B.namespace).pages == b_pages
    assert cache.match(tokens, A.namespace).pages == a_pages
    # a split under one namespace leaves the other's path whole
    assert cache.match(tokens[:PS] + [999] * PS, B.namespace).pages == b_pages[:1]
    assert cache.match(tokens, A.namespace).pages == a_pages
    # the registry hears salted hashes only: each namespace's own chain, never the unsalted one
    salted = {ns: chained_page_hashes(tokens, PS, seed=ns) for ns in (A.namespace, B.namespace)}
    assert sorted(events.snapshot()) == sorted(salted[A.namespace] + salted[B.namespace])
    assert not set(chained_page_hashes(tokens, PS)) & set(events.snapshot())
    assert not set(salted[A.namespace]) & set(salted[B.namespace])
    assert cache.device_pages_by_tenant == {A.tenant: 3, B.tenant: 3}
    cache.reset()
    assert cache.device_pages_by_tenant == {} and alloc.num_free == alloc.capacity and len(events) == 0


def test_eviction_takes_from_the_tenant_over_its_share_first_then_least_recently_used():
    alloc = PageAllocator(9)
    cache = RadixCache(alloc, PS)
    conversation = list(range(1, 2 * PS + 1))
    cache.insert(conversation, alloc.allocate(2), A)  # the oldest
    floods = [[100 + 10 * k + i for i in range(2 * PS)] for k in range(3)]
    for flood in floods:
        cache.insert(flood, alloc.allocate(2), B)
    assert cache.device_pages_by_tenant == {A.tenant: 2, B.tenant: 6}
    over = {B.tenant}  # as KVManager would say with cache_share 0.5 of 8 pages: B holds 6
    assert cache.evict(2, lambda tenant: tenant in over) == 2  # B's oldest, not A's older one
    assert cache.device_pages_by_tenant == {A.tenant: 2, B.tenant: 4} and cache.stats.quota_evicted_pages == 2
    over.clear()  # nobody over: plain LRU, and the conversation is the oldest
    cache.evict(2, lambda tenant: tenant in over)
    assert cache.device_pages_by_tenant == {B.tenant: 4} and cache.stats.quota_evicted_pages == 2
    assert not cache.match(floods[0], B.namespace).pages and cache.match(floods[1], B.namespace).pages


# -- the engine ------------------------------------------------------------------------------------
def test_a_prompt_is_cached_for_its_own_namespace_only(model_dir):
    eng = make_engine(model_dir)
    prompt = random_prompts(1, [5 * PS + 2], seed=3)[0]
    first, cached = serve(eng, prompt, A)
    assert cached == 0
    again, cached = serve(eng, prompt, A)
    assert again == first and cached == 5 * PS  # the same tenant and salt: reused
    for other in (B, A_SALTED):  # another tenant, or the same one with another salt: computed again
        tokens, cached = serve(eng, prompt, other)
        assert tokens == first and cached == 0, other
    tokens, cached = serve(eng, prompt, B)
    assert tokens == first and cached == 5 * PS  # B's own copy now
    assert_all_pages_free(eng)
    assert eng.kv.cache.device_pages_by_tenant.keys() == {A.tenant, B.tenant}


def test_decode_reservations_hold_pages_of_their_own_namespace_only(model_dir):
    eng = make_engine(model_dir)
    prompt = random_prompts(1, [4 * PS + 1], seed=4)[0]
    serve(eng, prompt, A)
    res = eng.reserve("b", len(prompt), prompt, B)
    assert res.held_pages == [] and eng.kv.live_pages_by_tenant() == {B.tenant: 5}
    assert eng.cancel_reservation("b")
    res = eng.reserve("a", len(prompt), prompt, A)
    assert len(res.held_pages) == 4 and eng.kv.live_pages_by_tenant() == {A.tenant: 1}
    assert eng.cancel_reservation("a")
    assert_all_pages_free(eng)


@pytest.mark.parametrize("share, kept", [(0.5, True), (1.0, False)], ids=["quota", "plain-lru"])
def test_a_tenants_flood_evicts_its_own_pages_before_another_tenants_conversation(model_dir, share, kept):
    eng = make_engine(model_dir, pages=40, tenant_quota=TenantQuota(cache_share=share, live_share=1.0))
    opener = random_prompts(1, [5 * PS + 1], seed=5)[0]
    reply, _ = serve(eng, opener, A)
    floods = random_prompts(3, [14 * PS] * 3, seed=6)  # together more than the pool
    for flood in floods:
        rid = eng.add_request(flood, SamplingParams(temperature=0.0, max_tokens=1), scope=B)
        while eng.has_work:
            eng.step()
            if eng.get(rid) is not None:  # live pages count against B while it runs
                assert set(eng.kv.live_pages_by_tenant()) <= {B.tenant}
    assert_all_pages_free(eng)
    turn = opener + reply + random_prompts(1, [3], seed=7)[0]
    _, cached = serve(eng, turn, A)
    if kept:
        assert cached >= 5 * PS, f"A's conversation lost its cache to B's flood: {cached} tokens cached"
        assert eng.kv.cache.stats.quota_evicted_pages > 0
    else:
        assert cached == 0 and eng.kv.cache.stats.quota_evicted_pages == 0
    assert_all_pages_free(eng)


@pytest.mark.parametrize("share", [0.5, 1.0], ids=["quota", "fifo"])
def test_a_tenant_over_its_live_share_lets_another_tenants_request_in_first(model_dir, share):
    eng = make_engine(model_dir, pages=40, max_num_batched_tokens=100,
                      tenant_quota=TenantQuota(cache_share=1.0, live_share=share))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    b1, b2, b3 = (eng.add_request(p, params, scope=B) for p in random_prompts(3, [12 * PS] * 3, seed=8))
    a = eng.add_request(random_prompts(1, [2 * PS], seed=9)[0], params, scope=A)
    eng.step()  # B's first two fill 96 of the 100 tokens and hold 24 of 40 pages; 4 tokens are left
    assert eng.get(b1).status is ReqStatus.RUNNING and eng.get(b2).status is ReqStatus.RUNNING
    first_in = (a, b3) if share < 1.0 else (b3, a)
    assert eng.get(first_in[0]).status is ReqStatus.RUNNING and eng.get(first_in[1]).status is ReqStatus.WAITING
    assert eng.kv.live_pages_by_tenant()[B.tenant] >= 24
    assert eng.scheduler.num_passed_over == (1 if share < 1.0 else 0)
    while eng.has_work:
        eng.step()
    assert_all_pages_free(eng)


def test_tenant_page_counts_return_to_zero_after_aborts_and_n_sequences(model_dir):
    eng = make_engine(model_dir, pages=40)
    prompts = random_prompts(3, [6 * PS + 1, 3 * PS, 9], seed=10)
    ids = [eng.add_request(prompts[0], SamplingParams(temperature=0.7, max_tokens=6, n=3, seed=1), scope=A),
           eng.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=20), scope=B),
           eng.add_request(prompts[2], SamplingParams(temperature=0.0, max_tokens=20), scope=A_SALTED)]
    for _ in range(4):
        eng.step()
    live = eng.kv.live_pages_by_tenant()
    assert live[A.tenant] > 0 and live[B.tenant] > 0
    eng.abort(ids[1])
    assert B.tenant not in eng.kv.live_pages_by_tenant()
    while eng.has_work:
        eng.step()
    assert_all_pages_free(eng)  # check_idle: no live pages per tenant, cached ones add up
    cached = eng.kv.cache.device_pages_by_tenant
    assert sum(cached.values()) == eng.kv.cache.num_cached_pages and set(cached) <= {A.tenant, B.tenant}
    eng.kv.cache.reset()
    assert eng.kv.cache.device_pages_by_tenant == {}
