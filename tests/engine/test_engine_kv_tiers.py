"""KV that outlives the request, in the engine: the host tier under the device pool
(write-back on eviction, load back on reuse), and decode reservations that reuse the
leading pages a worker already holds so a writer fills only the rest. Every page of every
tier is accounted for after each step; tokens equal the no-cache engine's (float64)."""
from __future__ import annotations

import pytest
import torch

from shared.engine import kv_write_back
from shared.engine.engine import Engine
from shared.engine.kv_host_tier import HostKVTier, page_runs
from shared.engine.kv_pool import KVLayout, KVPool, PageAllocator
from shared.engine.kv_write_back import WriteBackConfig
from shared.engine.kv_write_policy import SHARE_MIN_REQUESTS, HostTierWrites
from shared.engine.radix_cache import RadixCache
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, hf_greedy, kv_bytes_for_pages, load_hf

KIND = "qwen2_untied_bias"
PS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiers") / KIND, KIND, seed=5)


def make_engine(d, pages: int, host_pages: int = 0, **kw) -> Engine:
    per_page = kv_bytes_for_pages(d, 1, PS)
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=PS, max_num_batched_tokens=16,
                kv_cache_memory=pages * per_page, kv_host_memory=host_pages * per_page)
    opts.update(kw)
    return Engine(**opts)


def check_tree(cache: RadixCache) -> None:
    """Residency is prefix-closed; counters match the tree."""
    dev = host = 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.pages or child.host_pages, "a node holding nothing stayed in the tree"
            if child.pages:
                assert node is cache.root or node.pages, "device node under a node the device lost"
            dev += len(child.pages)
            host += len(child.host_pages)
            stack.append(child)
    assert dev == cache.num_cached_pages and host == cache.num_host_pages


def assert_idle_all_tiers(engine: Engine) -> None:
    assert_all_pages_free(engine)  # device pages, locks, reservations, host pages (check_idle)
    check_tree(engine.kv.cache)


# -- the tree and the tier, on their own ---------------------------------------------------------
def test_pages_written_back_on_eviction_come_back_with_their_bytes():
    layout = KVLayout(num_pages=6, num_layers=2, num_kv_heads=1, page_size=PS, head_dim=3, dtype=torch.float32)
    pool = KVPool(layout, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(layout.shape))
    host = HostKVTier(pool.buffer, layout, num_pages=4)
    alloc = PageAllocator(layout.num_pages)
    cache = RadixCache(alloc, PS, host=host, write_back=WriteBackConfig(policy="all"))
    a, b = list(range(100, 108)), list(range(200, 212))  # 2 and 3 pages
    pa, pb = alloc.allocate(2), alloc.allocate(3)
    want = {tuple(a): pool.buffer[pa].clone(), tuple(b): pool.buffer[pb].clone()}
    cache.insert(a, pa)
    cache.insert(b, pb)
    check_tree(cache)
    cache.writer.write_ahead(5)  # the older one's copy is queued; the host tier (4 pages) has no room for both
    assert cache.num_host_pages == 2 and cache.writer.busy
    assert cache.evict(5) == 5 and alloc.num_free == 5  # both left the device: a with its landed copy,
    # b without one (it was never copied: dropped, and counted so)
    check_tree(cache)
    assert cache.num_cached_pages == 0 and cache.num_host_pages == 2
    assert cache.writer.stats.pages == {("written", "all"): 2, ("dropped", "not_copied"): 3}
    kept = [t for t in (a, b) if cache.match(t).host_nodes]
    assert kept == [a]
    pool.buffer.zero_()
    for tokens in kept:
        m = cache.match(tokens)
        cache.lock(m.deepest)
        assert cache.load_back(m, lambda n: alloc.allocate(n)) == 1
        assert torch.equal(pool.buffer[m.pages], want[tuple(tokens)])
        cache.unlock(m.deepest)
        check_tree(cache)


def test_host_tier_drops_least_recently_used_leaves_for_room():
    layout = KVLayout(num_pages=8, num_layers=1, num_kv_heads=1, page_size=PS, head_dim=2, dtype=torch.float32)
    pool = KVPool(layout, torch.device("cpu"))
    host = HostKVTier(pool.buffer, layout, num_pages=4)
    alloc = PageAllocator(layout.num_pages)
    cache = RadixCache(alloc, PS, host=host, write_back=WriteBackConfig(policy="all"))
    seqs = [[k * 10 + i for i in range(2 * PS)] for k in range(4)]  # 2 pages each
    for s in seqs:
        cache.insert(s, alloc.allocate(2))
        cache.writer.write_ahead(2)  # the newest is copied to the host; the host holds two of them
        cache.evict(2)
        check_tree(cache)
    assert cache.num_host_pages == 4 and cache.num_cached_pages == 0
    assert [bool(cache.match(s).host_nodes) for s in seqs] == [False, False, True, True]
    assert cache.stats.host_evicted_pages == 4 and cache.stats.offloaded_pages == 8


def test_page_runs_merge_consecutive_pages_on_both_sides():
    assert page_runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert page_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]


# -- the engine ----------------------------------------------------------------------------------
def converse(engine: Engine, openers: list[list[int]], turns: int, follow: list[int], history=lambda a: a):
    """Lockstep chats: each turn's prompt is the last prompt + its answer as `history` gives it
    back (a client's text tokenized again may differ) + `follow`."""
    prompts, answers = [list(o) for o in openers], [[] for _ in openers]
    for turn in range(turns):
        if turn:
            prompts = [p + history(a) + [(x + turn) % 400 for x in follow] for p, a in zip(prompts, answers)]
        rids = [engine.add_request(p, GREEDY) for p in prompts]
        got = {r: [] for r in rids}
        while engine.has_work:
            for out in engine.step():
                got[out.rid].extend(out.token_ids)
            if engine.kv.cache.host is not None:
                check_tree(engine.kv.cache)
        answers = [got[r] for r in rids]
        assert_idle_all_tiers(engine)
        yield prompts, answers


def test_conversations_larger_than_the_device_pool_come_back_from_the_host(model_dir):
    """Write-back of every page (`all`): whatever the device gave up comes back."""
    openers = [[(7 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    follow = [5, 6, 7, 8, 9]
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    # 5 chats x ~10 pages: not on the device
    tiered = make_engine(model_dir, pages=20, host_pages=120, host_writes=HostTierWrites(policy="all"))
    roomy = make_engine(model_dir, pages=200)  # the same chats all on the device
    assert tiered.kv.cache.host is not None and ref.kv.cache.host is None
    for (p_ref, a_ref), (p_got, a_got), _ in zip(converse(ref, openers, 3, follow), converse(tiered, openers, 3, follow),
                                                 converse(roomy, openers, 3, follow)):
        assert p_ref == p_got and a_ref == a_got
    # what the host tier held was loaded back, never recomputed for want of device room (a
    # request whose prefix waits in the host tier waits for room instead); only retractions
    # of the tiny pool (decode growth) recompute anything
    assert tiered.stats.cached_tokens == roomy.stats.cached_tokens
    extra = tiered.stats.prefill_tokens_computed - roomy.stats.prefill_tokens_computed
    assert extra == 0 or (extra > 0 and tiered.scheduler.num_retracted > 0), (extra, tiered.scheduler.num_retracted)
    st = tiered.kv.cache.stats
    assert st.offloaded_pages > 0 and st.loaded_pages > 0 and st.host_hit_pages > 0
    assert tiered.stats.host_cached_tokens > 0
    assert tiered.stats.cached_tokens > tiered.stats.host_cached_tokens
    assert set(tiered.kv.cache.writer.stats.pages) == {("written", "all")}, "a page was dropped"


def test_the_reused_policy_drops_first_turns_and_keeps_conversations(model_dir, monkeypatch):
    """The default policy: a chat's first turn was never read again when the device needs its
    pages, so it leaves without a copy (`not_reused`); the next turn extends it (recognised
    though its pages are gone), so what that turn inserts is kept (`conversation`) and turn 3
    reads it back from the host tier. Single prompts nobody sends again are never copied."""
    monkeypatch.setattr(kv_write_back, "WALK_SPACING", 0)  # every step walks (wall-clock spacing)
    openers = [[(7 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    follow = [5, 6, 7, 8, 9]
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    tiered = make_engine(model_dir, pages=20, host_pages=120)
    assert tiered.kv.cache.writer.policy == "reused"
    host_hits = []
    for turn, ((p_ref, a_ref), (p_got, a_got)) in enumerate(zip(converse(ref, openers, 3, follow),
                                                                converse(tiered, openers, 3, follow))):
        assert p_ref == p_got and a_ref == a_got
        host_hits.append(tiered.stats.host_cached_tokens)
    assert host_hits[0] == host_hits[1] == 0 and host_hits[2] > 0, host_hits
    pages = tiered.kv.cache.writer.stats.pages
    assert pages.get(("dropped", "not_reused"), 0) > 0 and pages.get(("written", "conversation"), 0) > 0
    assert not any(reason in ("copy_in_flight", "not_copied") for _, reason in pages), pages

    single = make_engine(model_dir, pages=20, host_pages=120)  # one-off prompts, more than the pool holds
    prompts = [[(13 * c + 5 * i) % 400 + 1 for i in range(30)] for c in range(8)]
    for _ in converse(single, prompts, 1, []):
        pass
    assert single.kv.cache.stats.device_evicted_pages > 0
    assert single.kv.cache.writer.stats.total("written") == 0 and single.kv.cache.host.bytes_saved == 0


def test_a_conversation_whose_history_differs_from_its_answers_tokens_is_still_kept(model_dir):
    """The history a client sends back seldom holds the answer's exact tokens (its text tokenized
    again, a reasoning section the template strips): each turn's prompt is the last prompt, then
    tokens other than the answer's. Its turns still extend the last prompt whole, so the reused
    policy keeps what they insert (`conversation`) and turn 3 reads it back from the host tier.
    (Recognised by the end of the whole sequence, answer included, no turn ever was.)"""
    openers = [[(7 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    follow = [5, 6, 7, 8, 9]
    retold = lambda answer: [(t + 11) % 400 + 1 for t in answer]  # noqa: E731
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    tiered = make_engine(model_dir, pages=20, host_pages=120)
    host_hits = []
    for (p_ref, a_ref), (p_got, a_got) in zip(converse(ref, openers, 3, follow, retold),
                                              converse(tiered, openers, 3, follow, retold)):
        assert p_ref == p_got and a_ref == a_got
        host_hits.append(tiered.stats.host_cached_tokens)
    assert host_hits[0] == host_hits[1] == 0 and host_hits[2] > 0, host_hits
    assert tiered.kv.cache.writer.stats.pages.get(("written", "conversation"), 0) > 0


def test_once_most_requests_continue_earlier_ones_first_turns_are_kept_too(model_dir, monkeypatch):
    """Staggered chats, as a chat product's arrive: each chat's second turn comes after two newer
    chats' first turns have taken the device. At first a first turn leaves without a copy (no
    sign on its pages) and its second turn recomputes it; once SHARE_MIN_REQUESTS have finished
    and about half of them continued an earlier one, first turns are kept too (`chat_traffic`)
    and second turns find them in the host tier. One-off prompts keep the share at 0 and nothing
    is copied."""
    # every step walks for copies: the walk's spacing is wall-clock time, which a busy machine
    # stretches until pages leave uncopied (not_copied), not what this test is about
    monkeypatch.setattr(kv_write_back, "WALK_SPACING", 0)
    chats, follow = 40, [5, 6, 7, 8, 9]
    openers = [[(7 * c + 3 * i) % 400 + 1 for i in range(22)] for c in range(chats)]
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    tiered = make_engine(model_dir, pages=20, host_pages=400)
    writer = tiered.kv.cache.writer

    def answer(engine, prompt):
        return next(converse(engine, [prompt], 1, []))[1][0]

    first: dict[int, list[int]] = {}
    turn2_host_hits = []
    for k in range(chats + 2):
        if k < chats:
            first[k] = answer(tiered, openers[k])
            assert first[k] == answer(ref, openers[k])
        if k >= 2:
            prompt = openers[k - 2] + first[k - 2] + follow
            before = tiered.stats.host_cached_tokens
            assert answer(tiered, prompt) == answer(ref, prompt)
            turn2_host_hits.append(tiered.stats.host_cached_tokens - before)
    assert tiered.kv.cache.stats.device_evicted_pages > 0
    assert turn2_host_hits[:8] == [0] * 8, turn2_host_hits  # the share not yet known: not kept
    assert all(h > 0 for h in turn2_host_hits[-12:]), turn2_host_hits
    assert writer.stats.pages.get(("written", "chat_traffic"), 0) > 0, writer.stats.pages
    assert 0.4 < writer.continued_share.share < 0.6 and writer.continued_share.keeps_first_turns

    single = make_engine(model_dir, pages=20, host_pages=400)
    for c in range(2 * SHARE_MIN_REQUESTS):
        answer(single, [(13 * c + 5 * i) % 400 + 1 for i in range(30)])
    assert single.kv.cache.stats.device_evicted_pages > 0
    assert single.kv.cache.writer.continued_share.share == 0.0
    assert single.kv.cache.writer.stats.total("written") == 0 and single.kv.cache.host.bytes_saved == 0


def _host_tier(engine) -> tuple[int, int]:
    """Runs on every rank: its host tier's pages and pinned bytes."""
    host = engine.kv.cache.host
    return host.allocator.num_pages, host.buffer.numel() * host.buffer.element_size()


def test_tp2_host_tier_is_the_workers_budget_split_over_its_ranks(model_dir):
    """--kv-host-memory is the worker's: each of two ranks holds its shard of every host page
    (half the bytes), not the whole budget again; and the tier works under TP (the follower
    copies the same pages of its shard): TP=1's tokens, with pages offloaded and loaded."""
    openers = [[(7 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    follow = [5, 6, 7, 8, 9]
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    tiered = make_engine(model_dir, pages=10, host_pages=120, tp=2)  # 10 whole pages = 20 per rank's shard
    try:
        ranks = [_host_tier(tiered)] + tiered._tp_workers.call("tests.engine.test_engine_kv_tiers:_host_tier")
        assert [pages for pages, _ in ranks] == [120, 120]
        assert sum(nbytes for _, nbytes in ranks) == kv_bytes_for_pages(model_dir, 120, PS)
        for (p_ref, a_ref), (p_got, a_got) in zip(converse(ref, openers, 3, follow),
                                                  converse(tiered, openers, 3, follow)):
            assert p_ref == p_got and a_ref == a_got
        st = tiered.kv.cache.stats
        assert st.offloaded_pages > 0 and st.loaded_pages > 0 and st.host_hit_pages > 0
    finally:
        tiered.close()


def test_without_a_host_tier_evicted_pages_are_gone(model_dir):
    eng = make_engine(model_dir, pages=20)
    openers = [[(3 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    for _ in converse(eng, openers, 2, [1, 2, 3]):
        pass
    assert eng.kv.cache.host is None and eng.kv.cache.stats.dropped_pages > 0
    assert eng.stats.host_cached_tokens == 0


def _split_turn(pre: Engine, dec: Engine, key: str, prompt: list[int], params):
    """Prefill on `pre`; reserve on `dec` with the prompt's ids (held pages reused); copy
    only the pages the reservation asks for; decode there. Returns (tokens, held, fresh)."""
    rid = pre.add_request(prompt, params, prefill_only=True)
    first = None
    while pre.has_work:
        for out in pre.step():
            first = out.token_ids[0]
    src = pre.get(rid).page_ids
    res = dec.reserve(key, len(prompt), prompt_ids=prompt)
    held = len(res.held_pages)
    # the "transfer": only pages from `held` on
    dec.pool.buffer[res.fresh_pages] = pre.pool.buffer[src[held:held + len(res.fresh_pages)]]
    pre.release_held(rid)
    drid = dec.add_prefilled(key, prompt, first, SamplingParams(**vars(params)), seed=None)
    toks = [first]
    while dec.has_work:
        for out in dec.step():
            if out.rid == drid:
                toks.extend(out.token_ids)
    return toks, held, len(res.fresh_pages)


@pytest.mark.parametrize("dec_pages,host_pages", [(64, 0), (20, 64)])
def test_split_turns_move_only_what_decode_lacks(model_dir, dec_pages, host_pages):
    """Turn 2+ of a chat: decode holds the last turn's prompt and answer, so the writer
    fills only the new tail; with a small device pool the held pages come from the host."""
    pre = make_engine(model_dir, pages=64)
    dec = make_engine(model_dir, pages=dec_pages, host_pages=host_pages, host_writes=HostTierWrites(policy="all"))
    hf = load_hf(model_dir, torch.float64)
    prompt = [(11 * i) % 300 + 3 for i in range(30)]
    moved = []
    for turn in range(3):
        toks, held, fresh = _split_turn(pre, dec, f"r{turn}", prompt, GREEDY)
        assert toks == hf_greedy(hf, prompt, GREEDY.max_tokens)
        moved.append(fresh / dec.kv.pages_for(len(prompt)))
        if turn:
            assert held >= (len(prompt) - 12) // PS - 1, "decode kept the last turn"
        assert_idle_all_tiers(pre)
        assert_idle_all_tiers(dec)
        if host_pages:  # push this conversation off the device between turns, written back first
            dec.kv.cache.writer.write_ahead(dec.kv.cache.num_cached_pages)
            dec.kv.cache.evict(dec.kv.cache.num_cached_pages)
        prompt = prompt + toks + [7, 8, 9, 10, 11]
    assert moved[0] == 1.0 and max(moved[1:]) < 0.4
    if host_pages:
        assert dec.kv.cache.stats.loaded_pages > 0


def test_a_cancelled_reservation_unlocks_its_held_prefix(model_dir):
    dec = make_engine(model_dir, pages=32)
    prompt = list(range(1, 19))
    for _ in converse(dec, [prompt], 1, []):
        pass
    res = dec.reserve("r", len(prompt) + 4, prompt_ids=prompt + [1, 2, 3, 4])
    assert len(res.held_pages) == 4 and dec.kv.cache.num_locked_pages == 4
    assert dec.cancel_reservation("r")
    assert_idle_all_tiers(dec)


def test_kv_events_follow_pages_through_the_tiers():
    from shared.registry.kv_events import KvEventBuffer
    layout = KVLayout(num_pages=6, num_layers=1, num_kv_heads=1, page_size=PS, head_dim=2, dtype=torch.float32)
    pool = KVPool(layout, torch.device("cpu"))
    alloc = PageAllocator(layout.num_pages)
    events = KvEventBuffer()
    cache = RadixCache(alloc, PS, events=events, host=HostKVTier(pool.buffer, layout, num_pages=2),
                       write_back=WriteBackConfig(policy="all"))
    tokens = list(range(2 * PS))
    cache.insert(tokens, alloc.allocate(2))
    held = events.snapshot()
    assert len(held) == 2 and events.num_host_only == 0
    cache.writer.write_ahead(2)
    cache.evict(2)  # device -> host: still held, now host-only
    assert sorted(events.snapshot()) == sorted(held) and events.num_host_only == 2
    m = cache.match(tokens)
    cache.lock(m.deepest)
    cache.load_back(m, alloc.allocate)  # back on the device
    cache.unlock(m.deepest)
    assert events.num_host_only == 0
    cache.evict(2)
    cache._evict_host(2)  # and gone
    assert len(events) == 0 and events.num_host_only == 0
