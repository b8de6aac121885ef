"""A KV pool of a few pages under many requests: nothing crashes, requests are retracted
and recomputed, every answer equals the big-pool answer, and the pages all come back.
Requests that can never fit, or are malformed, are refused with a clear ValueError."""
from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (assert_all_pages_free, build_model_dir, hf_greedy, kv_bytes_for_pages,
                                 load_hf, random_prompts, run_engine)

KIND = "llama_tied_gqa2"


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("bp") / KIND, KIND, seed=31)


def engine(d, pages=None, page_size=4, **kw):
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=page_size, max_num_batched_tokens=16,
                kv_cache_memory=kv_bytes_for_pages(d, pages or 512, page_size))
    opts.update(kw)
    return Engine(**opts)


@pytest.mark.parametrize("pages,page_size,prefix_cache", [(13, 4, True), (13, 4, False), (5, 16, True)])
def test_tiny_pool_many_requests_finish_with_big_pool_tokens(model_dir, pages, page_size, prefix_cache):
    prompts = random_prompts(12, [5, 19, 2, 30, 11, 24, 8], seed=32)
    # some prompts share a prefix, so the cache and eviction take part too
    prompts += [prompts[3][:20] + p for p in random_prompts(3, [3, 9, 6], seed=33)]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + (i % 3) * 4, ignore_eos=True)
              for i in range(len(prompts))]
    big = run_engine(engine(model_dir), prompts, params)
    small = engine(model_dir, pages=pages, page_size=page_size, enable_prefix_cache=prefix_cache)
    assert small.kv.capacity == pages - 1
    got = run_engine(small, prompts, params)
    assert [g.token_ids for g in got] == [b.token_ids for b in big]
    assert all(g.finish_reason == "length" for g in got)
    assert small.scheduler.num_retracted > 0  # the pool really ran out mid-decode
    assert_all_pages_free(small)


def test_tiny_pool_matches_hf(model_dir):
    """The retract-and-recompute path against the outside reference, not just ourselves."""
    hf = load_hf(model_dir, torch.float64)
    prompts = random_prompts(6, [14, 3, 25, 9], seed=34)
    eng = engine(model_dir, pages=11, max_num_batched_tokens=8)
    got = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [g.token_ids for g in got] == [hf_greedy(hf, p, 12) for p in prompts]
    assert eng.scheduler.num_retracted > 0
    assert_all_pages_free(eng)


def test_request_too_big_for_the_pool_is_refused(model_dir):
    eng = engine(model_dir, pages=9)  # 8 usable pages of 4 tokens = 32 tokens
    prompt = random_prompts(1, [20], seed=35)[0]
    with pytest.raises(ValueError, match="needs 33 tokens of KV; this worker holds 32"):
        eng.add_request(prompt, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="KV"):
        eng.add_request(random_prompts(1, [40], seed=36)[0], SamplingParams(max_tokens=1))
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12))  # exactly fits
    while eng.has_work:
        eng.step()
    assert_all_pages_free(eng)


def test_n_sequences_fit_by_the_shared_prompt_rule(model_dir):
    """n sequences share the prompt's full pages (shared/admission/kv_demand.py): what the
    rule admits runs to the end in the pool, what it refuses needs one page more."""
    eng = engine(model_dir, pages=9)  # 8 usable pages of 4 tokens
    prompt = random_prompts(1, [20], seed=35)[0]  # 5 full pages; each sequence owns 1 more
    with pytest.raises(ValueError, match="needs 36 tokens of KV; this worker holds 32"):
        eng.add_request(prompt, SamplingParams(max_tokens=4, n=4))  # 5 + 4 pages
    rid = eng.add_request(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=4, n=3, ignore_eos=True))
    tokens: dict[int, list[int]] = {}
    while eng.has_work:
        for out in eng.step():
            assert out.rid == rid and out.error is None
            tokens.setdefault(out.index, []).extend(out.token_ids)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 4 for t in tokens.values()), tokens
    assert eng.scheduler.num_retracted == 0  # it fit: nothing was pushed out to make room
    assert_all_pages_free(eng)


def test_context_length_limits(model_dir):
    eng = engine(model_dir, max_model_len=40)
    assert eng.max_model_len == 40
    p30 = random_prompts(1, [30], seed=37)[0]
    # the one context rule (shared/admission/context_rule.py), in OpenAI's words
    with pytest.raises(ValueError, match=r"context length is 40 tokens\. However, you requested 41 tokens "
                                         r"\(30 in the prompt, 11 in the completion\)"):
        eng.add_request(p30, SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="context length is 40"):
        eng.add_request(random_prompts(1, [40], seed=38)[0], SamplingParams(max_tokens=1))
    # max_tokens=None: generate up to the context length
    (res,) = run_engine(eng, [p30], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(res.token_ids) == 10 and res.finish_reason == "length"
    # max_model_len above the model's own limit is clamped to it (512 here)
    assert engine(model_dir, max_model_len=10_000).max_model_len == 512
    assert_all_pages_free(eng)


def test_malformed_prompts_are_refused(model_dir):
    eng = engine(model_dir)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        eng.add_request([5, 512], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        eng.add_request([-1, 5], SamplingParams())
    eng.add_request([5, 6], SamplingParams(max_tokens=2), rid="dup")
    with pytest.raises(ValueError, match="duplicate request id"):
        eng.add_request([5, 6], SamplingParams(max_tokens=2), rid="dup")
    while eng.has_work:
        eng.step()
    assert_all_pages_free(eng)


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence"),
    (dict(frequency_penalty=-2.5), "frequency"), (dict(logprobs=21), "logprobs"),
    (dict(seed="x"), "seed"), (dict(min_tokens=-1), "min_tokens")])
def test_bad_sampling_params_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
