"""Every KV page comes back: after requests finish, and after aborts while waiting,
mid-prefill and mid-decode. Aborts leave the other requests' tokens untouched."""
from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (assert_all_pages_free, build_model_dir, hf_greedy, kv_bytes_for_pages,
                                 load_hf, random_prompts, run_engine)

KIND = "qwen2_untied_bias"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("kv") / KIND, KIND, seed=11)
    return d, load_hf(d, torch.float64)


def make_engine(d, **kw):
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=8,
                kv_cache_memory=4 << 20)
    opts.update(kw)
    return Engine(**opts)


def step_until(step, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        step()
    raise AssertionError("condition never reached")


def test_pages_return_after_finishing_and_usage_is_live_work_only(model):
    d, _ = model
    eng = make_engine(d)
    cap = eng.kv.capacity
    assert eng.kv.allocator.num_free == cap and eng.kv_usage == 0
    prompts = random_prompts(5, [7, 19, 3, 26, 12], seed=21)
    for p in prompts:
        eng.add_request(p, GREEDY)
    eng.step()
    eng.step()
    assert eng.kv_usage > 0  # live work holds pages
    assert eng.kv.allocator.num_free < cap
    while eng.has_work:
        eng.step()
    assert_all_pages_free(eng)
    # finished requests left their full pages in the prefix cache (evictable, not "used")
    assert eng.kv.cache.num_cached_pages > 0
    assert eng.kv.allocator.num_free == cap - eng.kv.cache.num_cached_pages
    # evicting the cache gives back the whole pool
    eng.kv.cache.reset()
    assert eng.kv.allocator.num_free == cap and eng.kv.cache.num_cached_pages == 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_aborts_waiting_mid_prefill_mid_decode_free_every_page(model, prefix_cache):
    d, hf = model
    eng = make_engine(d, enable_prefix_cache=prefix_cache, max_running_requests=3)
    long_prompt, keeper, decoder, waiter = random_prompts(4, [30, 9, 6, 11], seed=22)
    r_prefill = eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=20))
    r_keep = eng.add_request(keeper, GREEDY)
    r_dec = eng.add_request(decoder, SamplingParams(temperature=0.0, max_tokens=30))
    r_wait = eng.add_request(waiter, GREEDY)  # max_running_requests=3 keeps it queued
    got: dict[str, list[int]] = {}

    def step():
        for out in eng.step():
            got.setdefault(out.rid, []).extend(out.token_ids)

    step()  # 8 tokens of the long prompt
    req = eng.get(r_prefill)
    assert 0 < req.num_computed < len(long_prompt) and req.status is ReqStatus.RUNNING
    assert eng.get(r_wait).status is ReqStatus.WAITING
    out = eng.abort(r_prefill)
    assert out.finished and out.finish_reason == "abort"
    assert eng.get(r_prefill) is None
    out = eng.abort(r_wait)
    assert out.finish_reason == "abort" and eng.get(r_wait) is None

    step_until(step, lambda: len(got.get(r_dec, [])) >= 3)
    assert eng.get(r_dec).is_decoding
    assert eng.abort(r_dec).finish_reason == "abort"
    assert eng.abort(r_dec) is None  # unknown / already gone
    while eng.has_work:
        step()
    assert got[r_keep] == hf_greedy(hf, keeper, 10)  # the survivor is unaffected
    assert got[r_dec] == hf_greedy(hf, decoder, 30)[: len(got[r_dec])]
    assert_all_pages_free(eng)


def test_kv_of_an_aborted_prefill_is_reused_correctly(model):
    """Pages computed before a mid-prefill abort go to the prefix cache; a later request
    for the same prompt starts from them and still gets HF's tokens."""
    d, hf = model
    eng = make_engine(d)
    prompt = random_prompts(1, [30], seed=23)[0]
    rid = eng.add_request(prompt, GREEDY)
    eng.step()
    eng.step()  # 16 of 30 prompt tokens computed
    eng.abort(rid)
    assert_all_pages_free(eng)
    assert eng.kv.cache.num_cached_pages == 4
    (res,) = run_engine(eng, [prompt], GREEDY)
    assert res.num_cached_tokens == 16
    assert res.token_ids == hf_greedy(hf, prompt, 10)
    assert_all_pages_free(eng)


def test_abort_everything_in_a_busy_engine(model):
    d, _ = model
    eng = make_engine(d, kv_cache_memory=kv_bytes_for_pages(d, 24, 4))
    rids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=25))
            for p in random_prompts(10, [3, 14, 22, 9], seed=24)]
    for _ in range(6):
        eng.step()
    assert eng.kv_usage > 0.5
    for rid in rids:
        eng.abort(rid)
    assert not eng.has_work
    assert_all_pages_free(eng)
