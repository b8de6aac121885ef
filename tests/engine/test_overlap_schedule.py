"""Overlap scheduling gives exactly the tokens of the plain step loop.

CPU, float64 tiny Qwen3: greedy and seeded sampling, requests that end at different
steps (lengths, a stop token), one aborted mid-flight, logprobs (the synchronous path),
and the page accounting afterwards. The device-side sampler must choose what the host
sampler chooses."""
from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, Engine, SamplingParams
from shared.engine.overlap import sample_on_device
from shared.engine.sampler import SampleRow, sample

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ovl") / "qwen3", "qwen3")


def _workload():
    prompts = [[5, 6, 7, 8, 9] * 7, [10, 11, 12], list(range(20, 60)), [3] * 17, [40, 41] * 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 1, 9)]
    params.append(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=30, min_tokens=2, ignore_eos=False))
    return prompts, params


def _run(model_dir, overlap: bool, params):
    llm = LLM(str(model_dir), dtype="float64", device="cpu", num_threads=1, overlap_schedule=overlap)
    prompts, _ = _workload()
    outs = llm.generate(prompts, params)
    llm.engine.check_idle()
    return [(o.token_ids, o.finish_reason) for o in outs], llm.engine


def test_overlap_matches_plain_loop(model_dir):
    _, params = _workload()
    plain, _ = _run(model_dir, False, params)
    # make request 4 stop on a token it really produces (its 5th), after min_tokens
    stop_tok = plain[4][0][4]
    params[4].stop_token_ids = [stop_tok]
    plain, _ = _run(model_dir, False, params)
    assert plain[4][1] == "stop" and plain[4][0][-1] == stop_tok
    over, eng = _run(model_dir, True, params)
    assert over == plain
    assert eng.overlap is not None and eng.overlap.num_sync_steps == 0
    assert eng.stats.requests_finished == 5


def test_overlap_logprobs_take_the_synchronous_path(model_dir):
    _, params = _workload()
    params[0].logprobs = 2
    plain, _ = _run(model_dir, False, params)
    over, eng = _run(model_dir, True, params)
    assert over == plain
    assert eng.overlap.num_sync_steps > 0


def test_abort_while_a_step_is_in_flight(model_dir):
    eng = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", num_threads=1, overlap_schedule=True)
    a = eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = eng.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    got: dict[str, list[int]] = {a: [], b: []}
    for _ in range(4):
        for out in eng.step():
            got[out.rid] += out.token_ids
    assert eng.overlap.pending is not None  # a step is launched and not yet read back
    eng.abort(a)
    while eng.has_work:
        for out in eng.step():
            got[out.rid] += out.token_ids
    assert len(got[b]) == 6 and all(t >= 0 for t in got[a] + got[b])
    eng.check_idle()


def test_prefill_only_requests_awaiting_their_token_are_never_retracted(model_dir):
    """A prefill worker under page pressure: prefill-only requests whose first token is still
    being sampled hold their pages; the scheduler must not retract them to make room (their
    result would land on a request that lost its KV: HELD with no pages, and its transfer
    would never finish). Every request ends HELD with all of its prompt's pages and the
    plain loop's first token. (Found by a random search: this case failed before.)"""
    lengths = [30, 18, 28, 11, 24]
    prompts = [list(range(20, 20 + n)) for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=1)
    plain = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", num_threads=1,
                   overlap_schedule=False, page_size=4)
    want = {}
    for p in prompts:
        plain.add_request(p, params)
        while plain.has_work:
            for out in plain.step():
                want[len(p)] = out.token_ids[0]
    page_bytes = 2 * 2 * 2 * 4 * 16 * 8  # layers x (K, V) x kv heads x page x head_dim x float64
    eng = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", num_threads=1, overlap_schedule=True,
                 page_size=4, max_num_batched_tokens=8, kv_cache_memory=18 * page_bytes)
    assert eng.kv.capacity == 17
    rids = {eng.add_request(p, params, prefill_only=True): len(p) for p in prompts}
    held = {}
    for _ in range(400):
        if not eng.has_work:
            break
        for out in eng.step():
            if out.prefill_done:
                req = eng.get(out.rid)
                assert len(req.page_ids) * 4 >= rids[out.rid] and req.num_kv_ready >= rids[out.rid]
                held[rids[out.rid]] = out.token_ids[0]
                eng.release_held(out.rid)  # its transfer is done: free the pages
    assert held == want
    eng.check_idle()


def test_device_sampler_matches_host_sampler():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g, dtype=torch.float64) * 3
    specs = [dict(temperature=0), dict(temperature=0.7, seed=1), dict(temperature=1.0, top_k=5, seed=2),
             dict(temperature=0.5, top_p=0.8, seed=3), dict(temperature=1.3, min_p=0.05, seed=4),
             dict(temperature=0)]
    rows = []
    for i, kw in enumerate(specs):
        seed = kw.pop("seed", 0)
        rows.append(SampleRow(params=SamplingParams(**kw), seed=seed, position=10 + i, prompt_ids=[1],
                              output_ids=[], suppress_ids=[int(logits[i].argmax())] if i == 5 else []))
    want = sample(logits, rows).token_ids
    got = sample_on_device(logits, rows).tolist()
    assert got == want
    assert got[5] != int(logits[5].argmax())  # suppression applied
