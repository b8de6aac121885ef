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

from .tiny_models import make_tiny_model


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
