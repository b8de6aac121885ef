"""Write-back to the host tier never holds a step up and is never read half-written.

The copies run on a lane the test holds (tests/helpers/held_copy_lane.py: real copies on a
worker thread, one page at a time, each when the test lets it), so a copy stays in flight
for as many steps as the test likes:
- the engine keeps stepping at the same pace (the same steps, the same tokens as an engine
  without a host tier) while a write-back copy is held; had a step waited for it, the test
  would hang;
- a page whose copy is in flight and that the device needs at once is passed over while
  anything else can go, and its copy, once landed, reads back byte for byte;
- a page the device must reuse before its copy lands is dropped, its copy given up: the
  half-written host pages are never matched, and are freed only once the copy lands;
- the counters say what was written and what was dropped, and why."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from shared.engine.kv_host_tier import HostKVTier
from shared.engine.kv_pool import KVLayout, KVPool, PageAllocator
from shared.engine import kv_write_back as kwb
from shared.engine.kv_write_back import WriteBackConfig
from shared.engine import kv_write_policy as kwp
from shared.engine.kv_write_policy import ContinuedShare, FinishedPrompts
from shared.engine.radix_cache import RadixCache
from shared.engine.sampling_params import SamplingParams
from tests.engine.test_engine_kv_tiers import PS, assert_idle_all_tiers, check_tree, converse, make_engine
from tests.helpers.engine_models import build_model_dir
from tests.helpers.held_copy_lane import HeldCopyLane

KIND = "qwen2_untied_bias"

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("write-back") / KIND, KIND, seed=5)


# -- the tree and the tier, on their own ---------------------------------------------------------
def tiny_cache(device_pages: int = 8, host_pages: int = 8, policy: str = "reused"):
    """A cache over a pool whose page p holds the value p everywhere, and a held lane."""
    layout = KVLayout(num_pages=device_pages, num_layers=1, num_kv_heads=1, page_size=PS, head_dim=2,
                      dtype=torch.float32)
    pool = KVPool(layout, torch.device("cpu"))
    for p in range(device_pages):
        pool.buffer[p] = float(p)
    lane = HeldCopyLane()
    host = HostKVTier(pool.buffer, layout, num_pages=host_pages, lane=lane)
    alloc = PageAllocator(device_pages)
    cache = RadixCache(alloc, PS, host=host, write_back=WriteBackConfig(policy=policy))
    return cache, pool, alloc, lane


def read_back(cache: RadixCache, alloc: PageAllocator, pool, tokens) -> torch.Tensor:
    m = cache.match(tokens)
    assert m.host_nodes and not m.pages, "not held in the host tier only"
    cache.lock(m.deepest)
    wanted = len(m.host_nodes)
    assert cache.load_back(m, alloc.allocate) == wanted
    out = pool.buffer[m.pages].clone()
    cache.unlock(m.deepest)
    return out


def test_first_turns_are_kept_from_a_quarter_of_continued_requests_until_under_a_fifth():
    """The traffic counts as chats only once enough requests finished, and a share near the line
    does not flip the rule back and forth: on at FIRST_TURN_SHARE, off only under
    FIRST_TURN_SHARE_OFF."""
    share = ContinuedShare()
    for i in range(kwp.SHARE_MIN_REQUESTS - 1):
        share.count(continued=i % 2 == 0)  # half continued, but too few requests yet
        assert not share.keeps_first_turns
    share.count(continued=True)
    assert share.share > 0.5 and share.keeps_first_turns
    while share.share >= kwp.FIRST_TURN_SHARE_OFF:  # one-off prompts now: the share decays
        assert share.keeps_first_turns
        share.count(continued=False)
    assert not share.keeps_first_turns
    while share.share < kwp.FIRST_TURN_SHARE:  # chats again: back on only at the higher line
        assert not share.keeps_first_turns
        share.count(continued=True)
    assert share.keeps_first_turns


def test_a_reset_cache_forgets_the_finished_prompts_and_the_continued_share(model_dir):
    """Warm-up and calibration run requests of their own, then reset the cache: what they
    finished is not the traffic (calibration continues its own prompts on purpose)."""
    engine = make_engine(model_dir, pages=64, host_pages=64)
    chat = [[(7 * i) % 400 + 1 for i in range(22)]]
    for _ in converse(engine, chat, 2, [5, 6, 7, 8, 9]):
        pass
    writer = engine.kv.cache.writer
    assert writer.continued_share.seen == 2 and 0.49 < writer.continued_share.share < 0.51  # decayed counts
    assert writer.continued(chat[0] + [1, 2, 3], 0)
    engine.kv.cache.reset()
    assert writer.continued_share.seen == 0 and writer.continued_share.share == 0.0
    assert not writer.continued(chat[0] + [1, 2, 3], 0) and len(writer.prompts) == 0


def test_every_sequence_of_a_turn_with_n_answers_is_the_conversations(model_dir):
    """A chat's next turn asking n = 2 answers: both sequences continue the conversation, so what
    each inserts is the conversation's (kept by `reused`), not only the first sequence's."""
    engine = make_engine(model_dir, pages=64, host_pages=64)
    chat = [[(7 * i) % 400 + 1 for i in range(22)]]
    (_, answers), = list(converse(engine, chat, 1, []))
    rid = engine.add_request(chat[0] + answers[0] + [5, 6, 7, 8, 9],
                             SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True))
    run_until_done(engine, [rid])
    leaves, stack = [], [engine.kv.cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.children and node is not engine.kv.cache.root:
            leaves.append(node)
    assert len(leaves) == 2, "the two answers did not part"
    assert all(leaf.conversation for leaf in leaves), [leaf.conversation for leaf in leaves]


def test_a_turn_is_a_conversations_only_when_it_holds_a_finished_prompt_whole():
    """A short prompt's whole pages may be only a template every request shares: a later
    prompt is a conversation's turn when it holds all of a finished one, the tokens after its
    last whole page too, from its first token, under the same cache key."""
    template = list(range(100, 120))  # five whole pages of PS=4
    prompts = FinishedPrompts(PS)
    prompts.remember(template + [1, 2, 3], namespace=7)
    assert prompts.continued_by(template + [1, 2, 3, 9, 9], 7)
    assert prompts.continued_by(template + [1, 2, 3], 7)  # the prompt again (a match leaves the last token out)
    assert not prompts.continued_by(template + [4, 5, 6, 9, 9], 7), "the shared template made it a conversation"
    assert not prompts.continued_by(template + [1, 2], 7)
    assert not prompts.continued_by(template + [1, 2, 3, 9], 8), "another cache key's prompt"
    assert not prompts.continued_by([0] + template + [1, 2, 3], 7)
    few = FinishedPrompts(PS, capacity=2)
    for tail in ([1], [2], [3]):
        few.remember(template + tail, 7)
    assert len(few) == 2 and not few.continued_by(template + [1, 0], 7) and few.continued_by(template + [3, 0], 7)


def test_a_page_whose_copy_is_in_flight_is_passed_over_and_its_copy_reads_back_whole():
    cache, pool, alloc, lane = tiny_cache()
    kept, other = list(range(100, 108)), list(range(200, 208))  # 2 pages each
    pk, po = alloc.allocate(2), alloc.allocate(2)
    cache.insert(kept, pk)
    cache.insert(other, po)
    cache.match(kept, count_hit=True)  # a request found it: the policy wants it kept
    want = pool.buffer[pk].clone()
    cache.writer.write_ahead(4)
    assert cache.writer.busy and lane.submitted_pages == 2  # only the wanted one is copied
    lane.release(1)
    lane.wait_until(lambda: lane.pages_copied == 1)  # half done
    assert cache.evict(2) == 2  # the device needs two pages now: the other one goes
    assert cache.match(other).pages == [] and cache.match(kept).pages == pk
    lane.open()
    cache.writer.settle()
    assert cache.evict(2) == 2 and cache.num_cached_pages == 0  # landed: leaves at no cost
    pool.buffer[pk] = -1.0  # the device pages are someone else's now
    assert torch.equal(read_back(cache, alloc, pool, kept), want)
    assert cache.writer.stats.pages == {("written", "hit"): 2, ("dropped", "not_reused"): 2}
    check_tree(cache)


def test_with_nothing_else_left_eviction_takes_a_page_never_queued_before_one_whose_copy_is_in_flight():
    """Both wanted, neither landed: the copy in flight (the older page, queued first since
    eviction comes to it first) is not given up for the younger page that has no copy yet, so
    the write-back's work is not thrown away while it catches up with a pool turning over."""
    cache, pool, alloc, lane = tiny_cache()
    older, younger = list(range(100, 108)), list(range(200, 208))
    po, py = alloc.allocate(2), alloc.allocate(2)
    cache.insert(older, po)
    cache.insert(younger, py)
    cache.match(older, count_hit=True)
    cache.match(younger, count_hit=True)  # both wanted; `older` least recently used
    want = pool.buffer[po].clone()
    cache.writer.write_ahead(2)  # the window reaches the older one only
    assert lane.submitted_pages == 2
    assert cache.evict(2) == 2  # nothing can go at once: one of the two is dropped
    assert cache.writer.stats.pages == {("dropped", "not_copied"): 2}
    assert cache.match(younger).pages == [] and cache.match(older).pages == po
    lane.open()
    cache.writer.settle()
    assert cache.evict(2) == 2 and cache.num_cached_pages == 0  # landed: leaves at no cost
    pool.buffer[po] = -1.0
    assert torch.equal(read_back(cache, alloc, pool, older), want)
    assert cache.writer.stats.pages == {("dropped", "not_copied"): 2, ("written", "hit"): 2}
    check_tree(cache)


def test_a_prefill_chunk_waits_for_a_copy_in_flight_rather_than_give_it_up(model_dir):
    """On a GPU a copy queued at a step lands about two steps later, and under a pool that
    turns over (long prompts arriving while it is full) the pages it copies were the next ones
    eviction took: given up the moment they were queued, a chat's turns never reached the host
    tier. A prefill chunk now takes only what is free or can go at once, and runs the rest once
    the copy lands; nothing is given up, the tokens are the same, and the chat reads back."""
    chat = [[(7 * i) % 400 + 1 for i in range(22)]]
    follow = [5, 6, 7, 8, 9]
    prompt = [(13 * i) % 400 + 1 for i in range(60)]  # 15 pages: more than the pool has free
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    plain = make_engine(model_dir, pages=24)
    tiered = make_engine(model_dir, pages=24, host_pages=64)
    lane = HeldCopyLane()
    tiered.kv.cache.host.lane = lane
    writer = tiered.kv.cache.writer
    for engine in (plain, tiered):
        for _ in converse(engine, chat, 2, follow):  # turn 2 continued turn 1: worth keeping
            pass
    writer.write_ahead(tiered.kv.cache.num_cached_pages)
    held = lane.submitted_pages
    assert held > 0 and lane.pages_copied == 0
    rescue = threading.Timer(300, lane.open)
    rescue.start()
    want, _ = run_until_done(plain, [plain.add_request(prompt, params)])
    assert tiered.kv.allocator.num_free < len(prompt) // PS, "the prompt would not need the held pages"
    rid = tiered.add_request(prompt, params)
    for _ in range(20):  # the prompt's chunks take what is free...
        if tiered.kv.allocator.num_free == 0:
            break
        tiered.step()
        assert ("dropped", "copy_in_flight") not in writer.stats.pages, "a chunk gave a copy in flight up"
    assert tiered.kv.allocator.num_free == 0
    for _ in range(3):  # ...and then wait: the held copy's pages stay, the copy is not given up
        tiered.step()
    assert writer.stats.total("dropped") == writer.stats.pages.get(("dropped", "not_reused"), 0), writer.stats.pages
    assert tiered.has_work, "the prompt ran though the pages it needed were being copied"
    lane.open()
    got, _ = run_until_done(tiered, [rid])
    rescue.cancel()
    assert got[rid] == list(want.values())[0]
    pages = writer.stats.pages
    assert pages.get(("dropped", "copy_in_flight"), 0) == 0 and writer.stats.total("written") == held, pages
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    answers = [a for _, a in converse(ref, chat, 2, follow)]
    assert [a for _, a in converse(tiered, chat, 2, follow)] == answers
    assert tiered.stats.host_cached_tokens > 0
    assert_idle_all_tiers(tiered)


def test_a_page_reused_before_its_copy_lands_is_never_read_half_written():
    cache, pool, alloc, lane = tiny_cache(device_pages=5, host_pages=4)  # 4 usable device pages
    seq = list(range(100, 108))
    pages = alloc.allocate(2)
    cache.insert(seq, pages)
    cache.match(seq, count_hit=True)
    cache.writer.write_ahead(2)
    lane.release(1)
    lane.wait_until(lambda: lane.pages_copied == 1)  # its first page is in the host tier, its second is not
    assert cache.evict(2) == 2  # nothing else to free: its copy is given up, the pages go at once
    assert cache.writer.stats.pages == {("dropped", "copy_in_flight"): 2}
    reused = alloc.allocate(2)
    assert sorted(reused) == sorted(pages)
    pool.buffer[reused] = -7.0  # the new owner writes them while the old copy still reads them
    lane.open()
    cache.writer.settle()
    # the host pages now hold one old page and one new one: nothing may ever match them
    m = cache.match(seq)
    assert m.pages == [] and m.host_nodes == [], "a half-written copy is held"
    assert cache.num_host_pages == 0 and cache.writer.orphan_pages == 0
    assert cache.host.allocator.num_free == cache.host.capacity  # freed once the copy landed
    # the same host pages serve the next copy, which reads back whole
    alloc.free(reused)
    again = list(range(300, 308))
    fresh = alloc.allocate(2)
    pool.buffer[fresh[0]], pool.buffer[fresh[1]] = 11.0, 12.0
    want = pool.buffer[fresh].clone()
    cache.insert(again, fresh)
    cache.match(again, count_hit=True)
    cache.writer.write_ahead(2)
    cache.writer.settle()
    cache.evict(2)
    pool.buffer[fresh] = -1.0
    assert torch.equal(read_back(cache, alloc, pool, again), want)
    check_tree(cache)


# -- the engine ----------------------------------------------------------------------------------
def run_until_done(engine, rids) -> tuple[dict[str, list[int]], list[int]]:
    """Step until the requests end: their tokens, and the decode rows each step advanced."""
    got = {r: [] for r in rids}
    rows = []
    while engine.has_work:
        outs = engine.step()
        for out in outs:
            got[out.rid].extend(out.token_ids)
        rows.append(len(outs))
    return got, rows


def test_steps_keep_their_pace_while_a_write_back_copy_is_held(model_dir):
    """A chat whose pages the policy wants kept has its write-back copy held in flight, and
    one-off requests then need the device's pages: the engine runs them in the very steps an
    engine without a host tier does, with the same tokens, while not one page of the copy
    has moved. Released, the copy lands and the chat's next turn reads it back."""
    chat = [[(7 * i) % 400 + 1 for i in range(22)]]
    follow = [5, 6, 7, 8, 9]
    waves = [[[(11 * c + 3 * i) % 400 + 1 for i in range(14)] for c in range(w, w + 3)] for w in (0, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    plain = make_engine(model_dir, pages=28)  # the chat (~10 pages) and a wave (~18) at most
    tiered = make_engine(model_dir, pages=28, host_pages=64)
    lane = HeldCopyLane()
    tiered.kv.cache.host.lane = lane  # the host tier's copies now run at the test's pace
    writer = tiered.kv.cache.writer
    for engine in (plain, tiered):
        for _ in converse(engine, chat, 2, follow):  # turn 2 found turn 1: both are worth keeping
            pass
    writer.write_ahead(tiered.kv.cache.num_cached_pages)  # the chat's write-back is queued, and held
    assert lane.in_flight and lane.pages_copied == 0

    # a step that waited for the copy would wait forever: past this the lane lets go, and the
    # asserts below say so rather than the run hanging
    rescue = threading.Timer(300, lane.open)
    rescue.start()
    results = []
    for engine in (plain, tiered):  # the second wave needs the first one's pages, or the chat's
        for wave in waves:
            rids = [engine.add_request(p, params) for p in wave]
            steps_before = engine.stats.steps
            got, rows = run_until_done(engine, rids)
            results.append((engine is tiered, [got[r] for r in rids], engine.stats.steps - steps_before, rows))
    assert [r[1:] for r in results[2:]] == [r[1:] for r in results[:2]], "the held copy changed the steps or tokens"
    rescue.cancel()
    assert lane.in_flight and lane.pages_copied == 0, "the copy moved: a step waited for it"
    assert tiered.kv.cache.stats.device_evicted_pages > 0, "the one-off requests never needed pages back"
    # what left the device was the one-off prompts nobody will send again; the chat's pages,
    # whose copy is in flight, were passed over
    assert set(writer.stats.pages) == {("dropped", "not_reused")}, writer.stats.pages
    assert writer.busy and len(tiered.kv.cache.match(chat[0]).pages) >= len(chat[0]) // PS

    lane.open()
    writer.settle()
    assert writer.stats.total("written") == lane.submitted_pages > 0
    assert {reason for decision, reason in writer.stats.pages if decision == "written"} <= {"hit", "conversation"}
    tiered.kv.cache.evict(tiered.kv.cache.num_cached_pages)  # the chat leaves the device, kept on host
    ref = make_engine(model_dir, pages=64, enable_prefix_cache=False)
    answers = [a for _, a in converse(ref, chat, 2, follow)]
    assert [a for _, a in converse(tiered, chat, 2, follow)] == answers  # the same turns, read back
    assert tiered.stats.host_cached_tokens > 0
    assert_idle_all_tiers(tiered)


# -- on a GPU: the copy stream, page-locking in the background -------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's copy stream and page-locking")


def wait_landed(tier: HostKVTier, ticket: int) -> None:
    """The test waits (a step never does)."""
    deadline = time.monotonic() + 60
    while tier.poll() < ticket:
        assert time.monotonic() < deadline, "a copy never landed"
        time.sleep(0.001)


@needs_cuda
def test_on_a_gpu_the_tier_is_locked_in_the_background_and_copies_land_whole():
    dev = torch.device("cuda")
    layout = KVLayout(num_pages=128, num_layers=4, num_kv_heads=2, page_size=16, head_dim=64, dtype=torch.float16)
    pool = KVPool(layout, dev)
    pool.buffer.copy_(torch.randn(layout.shape, device=dev).to(layout.dtype))
    tier = HostKVTier(pool.buffer, layout, num_pages=640, pin_chunk_bytes=64 * layout.bytes_per_page)
    assert tier.pinner is not None and tier.pinner.wait(120) and not tier.pinner.failed, tier.pinner.failed
    assert tier.capacity <= 640  # what was locked when last polled
    tier.poll()
    assert tier.capacity == 640 and tier.allocator.num_free == 640
    dev_pages, host_pages = list(range(1, 101)), list(range(30, 130))  # the runs cross two locked chunks
    want = pool.buffer[dev_pages].clone()
    wait_landed(tier, tier.save(dev_pages, host_pages))
    assert torch.equal(tier.buffer[host_pages], want.cpu())
    pool.buffer.zero_()
    back = list(range(20, 120))
    wait_landed(tier, tier.load(host_pages, back))
    assert torch.equal(pool.buffer[back], want)


@needs_cuda
def test_on_a_gpu_chats_come_back_from_the_host_with_the_tokens_of_no_cache(model_dir):
    from shared.engine.engine import Engine
    from shared.engine.kv_write_policy import HostTierWrites
    from tests.helpers.engine_models import kv_bytes_for_pages
    per_page = kv_bytes_for_pages(model_dir, 1, PS, elem_bytes=4)

    def engine(pages: int, host_pages: int = 0, **kw) -> Engine:
        return Engine(model_dir=str(model_dir), dtype="float32", device="cuda", page_size=PS,
                      max_num_batched_tokens=16, kv_cache_memory=pages * per_page,
                      kv_host_memory=host_pages * per_page, **kw)
    openers = [[(7 * c + i) % 400 + 1 for i in range(22)] for c in range(5)]
    follow = [5, 6, 7, 8, 9]
    ref = engine(64, enable_prefix_cache=False)
    for policy in ("reused", "all"):
        tiered = engine(20, 120, host_writes=HostTierWrites(policy=policy))
        tiered.kv.cache.host.pinner.wait(60)
        for (p_ref, a_ref), (p_got, a_got) in zip(converse(ref, openers, 3, follow),
                                                  converse(tiered, openers, 3, follow)):
            assert p_ref == p_got and a_ref == a_got, policy
        assert tiered.stats.host_cached_tokens > 0, policy
        tiered.kv.cache.writer.settle()
        assert_idle_all_tiers(tiered)


@needs_cuda
def test_on_a_gpu_a_prefill_worker_captures_no_decode_graphs(model_dir):
    from shared.engine.engine import Engine
    from shared.engine.warmup import warm_up
    eng = Engine(model_dir=str(model_dir), dtype="float32", device="cuda", kv_cache_memory=64 << 20, runs_decode=False)
    assert eng.runner.graphs is None and eng.runner.prefill_graphs is not None
    warm_up(eng)
    rid = eng.add_request([(3 * i) % 400 + 1 for i in range(40)], SamplingParams(temperature=0.0, max_tokens=4),
                          prefill_only=True)
    while eng.has_work:
        eng.step()
    assert eng.get(rid).num_output == 1
    eng.release_held(rid)
    eng.check_idle()


def test_the_walk_ahead_of_eviction_is_spaced_by_its_own_cost_and_runs_at_once_when_the_pool_runs_shorter():
    """Each step asks the writer to look ahead (tick); the walk over the unlocked device nodes
    costs time on the step's thread that grows with the tree. A tree that takes long to walk is
    walked again only after WALK_SPACING times that long, unless the pool runs shorter than the
    last walk looked ahead for; a small tree is walked every step."""
    cache, pool, alloc, lane = tiny_cache(device_pages=4100, host_pages=8)
    for i in range(4000):  # a full pool of one-page nodes, none wanted (never hit): nothing to copy
        cache.insert([i + 1] + [0] * (PS - 1), alloc.allocate(1))
    walks = []
    order = cache.eviction_order
    cache.eviction_order = lambda: walks.append(1) or order()  # counts the walks; the walk itself is real
    writer = cache.writer
    writer.ahead_pages = 2000
    free = alloc.num_free
    started = time.perf_counter()
    writer.tick(free)
    first = writer._walk_s
    assert len(walks) == 1 and first > 0
    ticks = 0
    while time.perf_counter() - started < first * kwb.WALK_SPACING / 2:
        m = cache.match([ticks % 4000 + 1] + [0] * (PS - 1))  # a step's change to the tree: a lock
        cache.lock(m.deepest)                                  # taken and released
        cache.unlock(m.deepest)
        writer.tick(free)  # the same window, again and again within the spacing: no walk
        ticks += 1
    assert ticks > 1 and len(walks) == 1
    writer.tick(free - 10)  # the pool ran shorter than that walk looked for: at once
    assert len(walks) == 2
    time.sleep(writer._walk_s * kwb.WALK_SPACING * 1.5)
    cache.insert([9999] + [0] * (PS - 1), alloc.allocate(1))  # the tree changed (a walk that found
    writer.tick(free - 10)                                     # nothing is not repeated unless it did)
    assert len(walks) == 3  # spaced out, then walked again
    small, _, small_alloc, small_lane = tiny_cache(device_pages=8)
    seq = list(range(100, 108))
    small.insert(seq, small_alloc.allocate(2))
    small_walks = []
    small_order = small.eviction_order
    small.eviction_order = lambda: small_walks.append(1) or small_order()
    small.writer.ahead_pages = 8
    for _ in range(5):
        small.match(seq, count_hit=True)  # each step changes the tree (a hit)
        time.sleep(0.001)  # a step's time: far past a one-node walk's spacing
        small.writer.tick(small_alloc.num_free)
    assert len(small_walks) == 5
    small_lane.open()
    small.writer.settle()
