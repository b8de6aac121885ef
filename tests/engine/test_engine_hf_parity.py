"""Greedy output of our engine equals transformers' token for token.

Random-weight Llama / Qwen2 / Qwen3 models in float64 (so rounding cannot break a tie),
a batch of prompts of different lengths run together, chunked prefill forced small, page
sizes 4 and 16, prefix-cache hits, a sharded checkpoint; and the default model in float32.
The reference is HF `generate(do_sample=False)` run one prompt at a time, unpadded."""
from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (SMALL_CONFIGS, assert_all_pages_free, build_model_dir, hf_greedy,
                                 load_hf, random_prompts, run_engine)

MAX_NEW = 12
LENGTHS = [5, 13, 29, 2, 17, 8]
KV_BYTES = 8 << 20  # plenty for these tiny models without zeroing the 1 GiB CPU default


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """kind -> (model folder, prompts, HF greedy references), built once."""
    root = tmp_path_factory.mktemp("engine-models")
    out = {}
    for i, kind in enumerate(SMALL_CONFIGS):
        d = build_model_dir(root / kind, kind, seed=i)
        hf = load_hf(d, torch.float64)
        prompts = random_prompts(len(LENGTHS), LENGTHS, seed=100 + i)
        refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        out[kind] = (d, prompts, refs)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.mark.parametrize("page_size,budget", [(4, 8), (16, 16)])
@pytest.mark.parametrize("kind", list(SMALL_CONFIGS))
def test_batched_chunked_greedy_equals_hf(small_models, kind, page_size, budget):
    d, prompts, refs = small_models[kind]
    # references must be worth comparing: not one token repeated
    assert all(len(set(r)) >= 4 for r in refs), refs
    eng = Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=page_size,
                 max_num_batched_tokens=budget, kv_cache_memory=KV_BYTES)
    got = run_engine(eng, prompts, GREEDY)
    for g, ref, p in zip(got, refs, prompts):
        assert g.token_ids == ref, f"prompt of {len(p)} tokens diverged"
        assert g.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert eng.stats.steps > sum(len(p) for p in prompts) // budget  # chunking really happened
    assert eng.stats.prefill_tokens_computed == sum(len(p) for p in prompts)
    assert_all_pages_free(eng)


@pytest.mark.parametrize("kind", ["llama_tied_gqa2", "qwen3_headdim32"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefix_cache_hits_compute_less_and_give_the_same_tokens(small_models, tmp_path, kind, page_size):
    d, _, _ = small_models[kind]
    hf = load_hf(d, torch.float64)
    shared = random_prompts(1, [37], seed=7)[0]
    suffixes = random_prompts(4, [1, 14, 27, 20], seed=8)
    prompts = [shared + s for s in suffixes]
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    total = sum(len(p) for p in prompts)
    eng = Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=page_size, max_num_batched_tokens=16,
                 kv_cache_memory=KV_BYTES)

    # warm the cache with the shared prefix alone, then the batch hits it mid-prompt
    run_engine(eng, [shared], SamplingParams(temperature=0.0, max_tokens=1))
    before = eng.stats.prefill_tokens_computed
    first = run_engine(eng, prompts, GREEDY)
    computed_first = eng.stats.prefill_tokens_computed - before
    assert [r.token_ids for r in first] == refs
    hit = (len(shared) // page_size) * page_size
    assert all(r.num_cached_tokens >= hit for r in first), [r.num_cached_tokens for r in first]
    assert computed_first + sum(r.num_cached_tokens for r in first) == total
    assert computed_first < total

    # the same batch again: each prompt is cached up to its last full page before the end
    before = eng.stats.prefill_tokens_computed
    second = run_engine(eng, prompts, GREEDY)
    computed_second = eng.stats.prefill_tokens_computed - before
    assert [r.token_ids for r in second] == refs
    expect = [((len(p) - 1) // page_size) * page_size for p in prompts]
    assert [r.num_cached_tokens for r in second] == expect
    assert computed_second == total - sum(expect)
    assert computed_second < computed_first
    assert_all_pages_free(eng)
    assert eng.kv.cache.num_cached_pages > 0


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    d = build_model_dir(tmp_path / "sharded", "qwen2_untied_bias", seed=3, max_shard_size="40KB")
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 2 and (d / "model.safetensors.index.json").is_file()
    hf = load_hf(d, torch.float64)
    prompts = random_prompts(3, [9, 4, 21], seed=5)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    eng = Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=8,
                 kv_cache_memory=KV_BYTES)
    assert [r.token_ids for r in run_engine(eng, prompts, GREEDY)] == refs


def test_default_model_float32_greedy_equals_hf():
    from shared.model_files.default_model import ensure_default_model
    d = ensure_default_model(progress=False)
    eng = Engine(model_dir=str(d), page_size=16, max_num_batched_tokens=16, kv_cache_memory=64 << 20)
    assert eng.dtype == torch.float32
    tok = eng.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Here is a short list of fruits: apple, banana,"]
    prompts = [tok.encode(t) for t in texts]
    got = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=10))
    hf = load_hf(d, torch.float32)
    for g, p in zip(got, prompts):
        assert g.token_ids == hf_greedy(hf, p, 10)
    assert "Paris" in tok.decode(got[0].token_ids)
    assert_all_pages_free(eng)
