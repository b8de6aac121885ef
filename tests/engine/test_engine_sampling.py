"""Sampling through the real engine: greedy, temperature and the top-k / top-p / min-p
filters (checked against the distribution HF's logits imply), seeds (reproducible across
runs, batch compositions, chunk sizes and retraction), stops, max_tokens, ignore_eos,
penalties (against a reference computation and HF's repetition penalty) and logprobs."""
from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from shared.model_files.default_model import ensure_default_model
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (build_model_dir, hf_greedy, hf_logits, kv_bytes_for_pages, load_hf,
                                 random_prompts, run_engine, assert_all_pages_free)

KIND = "llama_untied_mha_llama3rope"
PROMPTS = random_prompts(4, [6, 12, 9, 20], seed=42)
KV = 8 << 20


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a real tokenizer (the default model's) so stop strings have text to match
    return build_model_dir(tmp_path_factory.mktemp("sampling") / KIND, KIND, seed=41,
                           tokenizer_from=ensure_default_model(progress=False))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir, torch.float64)


@pytest.fixture(scope="module")
def eng64(model_dir):
    return Engine(model_dir=str(model_dir), dtype="float64", device="cpu", kv_cache_memory=KV)


@pytest.fixture(scope="module")
def eng32(model_dir):
    return Engine(model_dir=str(model_dir), kv_cache_memory=KV)


def greedy(eng, n=20, prompts=PROMPTS, **kw):
    return run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw))


# -- filters and temperature -----------------------------------------------------------------
def test_filters_that_keep_one_token_equal_greedy(eng32):
    base = [r.token_ids for r in greedy(eng32)]
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-4)):
        params = SamplingParams(**{"temperature": 1.0, **kw}, seed=5, max_tokens=20, ignore_eos=True)
        assert [r.token_ids for r in run_engine(eng32, PROMPTS, params)] == base, kw


def test_temperature_sampling_differs_from_greedy_and_by_seed(eng32):
    base = [r.token_ids for r in greedy(eng32)]
    a = run_engine(eng32, PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    b = run_engine(eng32, PROMPTS, SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True))
    assert [r.token_ids for r in a] != base
    assert all(x.token_ids != y.token_ids for x, y in zip(a, b))


def _reference_dist(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The distribution the filters should sample from (vLLM's order: temperature first)."""
    probs = (logits / temperature).softmax(-1)
    sp, order = probs.sort(descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= (sp.cumsum(0) - sp) <= top_p
    keep &= sp >= min_p * sp[0]
    keep[0] = True
    q = torch.zeros_like(probs)
    q[order[keep]] = sp[keep]
    return q / q.sum()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6), dict(top_k=3),
                                dict(top_p=0.5), dict(min_p=0.1), dict(temperature=1.5, top_k=5, top_p=0.8)])
def test_first_token_frequencies_match_the_filtered_distribution(eng32, hf, kw):
    """2000 seeds on one prompt: empirical first-token frequencies vs HF's logits."""
    n = 2000
    prompt = PROMPTS[0]
    params = [SamplingParams(**{"temperature": 1.0, **kw}, seed=1000 + i, max_tokens=1) for i in range(n)]
    got = Counter(r.token_ids[0] for r in run_engine(eng32, [prompt] * n, params))
    q = _reference_dist(hf_logits(hf, prompt)[-1], **kw)
    support = set(torch.nonzero(q).flatten().tolist())
    assert set(got) <= support, f"sampled outside the allowed set: {set(got) - support}"
    for tok in support:
        p = q[tok].item()
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(got[tok] / n - p) < 5 * sigma + 2e-3, (tok, got[tok] / n, p)


# -- seeds ------------------------------------------------------------------------------------
def test_same_seed_same_tokens_alone_in_a_batch_and_across_chunk_sizes(model_dir):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = run_engine(Engine(model_dir=str(model_dir), kv_cache_memory=KV), [PROMPTS[1]], seeded)[0]
    again = run_engine(Engine(model_dir=str(model_dir), kv_cache_memory=KV), [PROMPTS[1]], seeded)[0]
    assert alone.token_ids == again.token_ids
    others = random_prompts(5, [3, 30, 7, 15, 22], seed=43)
    other_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=5 + 7 * i, ignore_eos=True)
                    for i in range(4)] + [SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=9)]
    eng = Engine(model_dir=str(model_dir), kv_cache_memory=KV, max_num_batched_tokens=7, page_size=4)
    mixed = run_engine(eng, others[:3] + [PROMPTS[1]] + others[3:], other_params[:3] + [seeded] + other_params[3:])
    assert mixed[3].token_ids == alone.token_ids
    assert eng.stats.steps > 10


def test_seeded_sampling_survives_retraction(model_dir):
    prompts = random_prompts(8, [9, 17, 4, 26], seed=44)
    params = [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=14, ignore_eos=True) for i in range(8)]
    big = run_engine(Engine(model_dir=str(model_dir), dtype="float64", device="cpu", kv_cache_memory=KV), prompts, params)
    tiny = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=12,
                  kv_cache_memory=kv_bytes_for_pages(model_dir, 12, 4))
    got = run_engine(tiny, prompts, params)
    assert tiny.scheduler.num_retracted > 0
    assert [g.token_ids for g in got] == [b.token_ids for b in big]
    assert_all_pages_free(tiny)


# -- stopping ---------------------------------------------------------------------------------
def test_max_tokens_gives_length(eng32):
    res = run_engine(eng32, PROMPTS, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert all(len(r.token_ids) == 7 and r.finish_reason == "length" and r.stop_reason is None for r in res)


def test_stop_token_ids(eng32):
    full = greedy(eng32, 20)[0].token_ids
    i = next(i for i in range(4, 20) if full[i] not in full[:i])
    (res,) = run_engine(eng32, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[full[i]]))
    assert res.token_ids == full[: i + 1]
    assert res.finish_reason == "stop" and res.stop_reason == full[i]


def test_stop_strings_cut_the_text_before_the_stop(eng32):
    import re
    tok = eng32.tokenizer
    full = greedy(eng32, 30)[1].token_ids
    text = tok.decode(full, skip_special_tokens=True)
    m = re.search(r"[a-z]{2,}", text[4:])
    assert m, text
    stop = m.group(0)
    want = text[: text.find(stop)]
    (res,) = run_engine(eng32, PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=30,
                                                            stop=["zzzz-never", stop]))
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == want
    assert res.token_ids == full[: len(res.token_ids)]
    assert stop in tok.decode(res.token_ids) and stop not in tok.decode(res.token_ids[:-1])
    # a stop string that never appears changes nothing
    (res,) = run_engine(eng32, PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=30, stop="zzzz-never"))
    assert res.token_ids == full and res.finish_reason == "length" and res.text == text


def test_eos_stops_unless_ignore_eos_and_min_tokens_suppresses_it(model_dir, eng32, hf, tmp_path):
    full = greedy(eng32, 20)[2].token_ids
    i = next(i for i in range(3, 20) if full[i] not in full[:i])
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    for name in ("generation_config.json", "config.json"):
        cfg = json.loads((eos_dir / name).read_text())
        cfg["eos_token_id"] = full[i]
        (eos_dir / name).write_text(json.dumps(cfg))
    eng = Engine(model_dir=str(eos_dir), kv_cache_memory=KV)
    (stopped,) = run_engine(eng, PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=20))
    assert stopped.token_ids == full[: i + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == hf_greedy(load_hf(eos_dir, torch.float32), PROMPTS[2], 20)
    (ignored,) = run_engine(eng, PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    (held,) = run_engine(eng, PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=i + 3))
    assert full[i] not in held.token_ids[: i + 3] and len(held.token_ids) >= i + 3
    assert held.token_ids[:i] == full[:i]


# -- penalties --------------------------------------------------------------------------------
def _repeats(ids):
    return len(ids) - len(set(ids))


def test_presence_and_frequency_penalties_match_a_reference_and_steer_repeats(eng64, hf):
    base = greedy(eng64, 60)
    for kw in (dict(presence_penalty=1.5), dict(frequency_penalty=0.8),
               dict(presence_penalty=-2.0), dict(frequency_penalty=-1.0, presence_penalty=0.5)):
        res = greedy(eng64, 60, **kw)
        fp, pp = kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0)
        for prompt, r in zip(PROMPTS, res):
            logits = hf_logits(hf, prompt + r.token_ids)[len(prompt) - 1:-1]
            for t, row in enumerate(logits):
                counts = torch.bincount(torch.tensor(r.token_ids[:t], dtype=torch.long),
                                        minlength=row.numel()).double()
                pen = row - fp * counts - pp * (counts > 0).double()
                assert pen.argmax().item() == r.token_ids[t], (kw, t)
        more = sum(_repeats(r.token_ids) for r in res) - sum(_repeats(b.token_ids) for b in base)
        assert (more > 0) if (fp + pp) < 0 else (more < 0), (kw, more)


def test_repetition_penalty_equals_hf(eng64, hf):
    for rp in (1.4, 0.8):
        res = run_engine(eng64, PROMPTS, SamplingParams(temperature=0.0, max_tokens=25, repetition_penalty=rp))
        for prompt, r in zip(PROMPTS, res):
            assert r.token_ids == hf_greedy(hf, prompt, 25, repetition_penalty=rp), rp
    base = greedy(eng64, 60)
    strong = greedy(eng64, 60, repetition_penalty=1.5)
    assert sum(map(_repeats, (r.token_ids for r in strong))) < sum(map(_repeats, (r.token_ids for r in base)))



def test_a_vanishing_repetition_penalty_keeps_the_logits_finite():
    """5e-324 is a valid float above 0 but 0 in float32: dividing by it must not leave inf
    (softmax would turn the row into NaN and the sampler would pick token 0 whatever a grammar
    allows: a fuzzed json_object request got 503 'token 0 does not fit the grammar')."""
    from shared.engine.sampler import SampleRow, apply_penalties

    logits = torch.tensor([[3.0, -2.0, 0.5, 7.0]])
    row = SampleRow(params=SamplingParams(repetition_penalty=5e-324), seed=0, position=0, prompt_ids=[0, 1],
                    output_ids=[3], suppress_ids=[])
    apply_penalties(logits, [row])
    assert torch.isfinite(logits).all() and logits.softmax(-1).isfinite().all()
    assert int(logits.argmax()) in (0, 3) and logits[0, 2] == 0.5  # a penalized token wins; the rest untouched

# -- logprobs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_hf_log_softmax(eng64, hf, temperature):
    params = SamplingParams(temperature=temperature, seed=9, max_tokens=12, logprobs=5, ignore_eos=True)
    for prompt, r in zip(PROMPTS, run_engine(eng64, PROMPTS, params)):
        ref = hf_logits(hf, prompt + r.token_ids)[len(prompt) - 1:-1].log_softmax(-1)
        assert len(r.logprobs) == len(r.token_ids) == len(r.top_logprobs) == 12
        for t, tok in enumerate(r.token_ids):
            assert abs(r.logprobs[t] - ref[t, tok].item()) < 1e-4
            top = r.top_logprobs[t]
            assert len(top) == 5
            vals = [v for _, v in top]
            assert vals == sorted(vals, reverse=True)
            assert top[0][0] == ref[t].argmax().item()
            ref_v, ref_i = ref[t].topk(5)
            assert [i for i, _ in top] == ref_i.tolist()
            assert max(abs(a - b) for a, b in zip(vals, ref_v.tolist())) < 1e-4
            if temperature == 0.0:
                assert top[0][0] == tok


def test_logprobs_zero_gives_only_the_chosen_token(eng64):
    (r,) = run_engine(eng64, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))
    assert all(lp is not None and lp <= 0 for lp in r.logprobs) and r.top_logprobs == [[]] * 4
    (r,) = run_engine(eng64, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
    assert r.logprobs == [None] * 4
