"""Warm-up before a worker says ready: it runs prompts of every token-count bucket, a
cached-prefix extend, decode batches and the host sampling path through the engine's own
loop, then leaves nothing behind (no cached pages, zeroed counters) and serves the same
tokens as an engine that never warmed up."""
from __future__ import annotations

import pytest

from shared.engine import Engine, SamplingParams
from shared.engine.warmup import warm_up

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("warm") / "qwen3", "qwen3", vocab=256)


@pytest.mark.parametrize("full", [False, True])
def test_warm_up_leaves_nothing_behind_and_changes_no_tokens(model_dir, full):
    kw = dict(model_dir=str(model_dir), dtype="float64", device="cpu", num_threads=1, page_size=4,
              max_num_batched_tokens=64, kv_cache_memory=4 << 20, max_model_len=512)
    prompts = [[5, 6, 7, 8, 9] * 5, [10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = Engine(**kw)
    want = _generate(cold, prompts, params)
    eng = Engine(**kw)
    warm_up(eng, full=full)
    assert eng.stats.steps == 0 and eng.stats.prefill_tokens_computed == 0
    assert eng.kv.cache.num_cached_pages == 0 and eng.kv.allocator.num_free == eng.kv.capacity
    assert _generate(eng, prompts, params) == want
    assert eng.stats.prefill_tokens_computed == sum(map(len, prompts))


def _generate(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    toks = {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            toks[out.rid] += out.token_ids
    return [toks[r] for r in rids]
