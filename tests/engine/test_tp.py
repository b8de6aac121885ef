"""Tensor parallelism across processes: TP=2 gives TP=1's greedy tokens.

CPU, gloo, float64, a random Qwen3-shaped model with 4 query / 2 KV heads, so each of
the two ranks holds 2 query heads and 1 KV head, half the MLP and half the vocabulary.
Rank 1 is a real separate process; the engine in this process is rank 0."""
from __future__ import annotations

import pytest

from shared.engine import LLM, SamplingParams

from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9] * 7, [10, 11, 12], list(range(20, 60))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # an odd vocabulary: rank 1's vocabulary shard carries one padding row
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "qwen3", "qwen3", vocab=251, heads=4, kv_heads=2)


def _params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6, 9)] + [
        SamplingParams(temperature=0.9, top_k=30, seed=11, max_tokens=10, ignore_eos=True)]


def test_tp2_matches_tp1(model_dir):
    prompts = PROMPTS + [[3] * 17]
    llm1 = LLM(str(model_dir), dtype="float64", device="cpu", num_threads=1)
    want = [o.token_ids for o in llm1.generate(prompts, _params())]
    del llm1
    llm2 = LLM(str(model_dir), dtype="float64", device="cpu", num_threads=1, tp=2)
    try:
        eng = llm2.engine
        assert eng.tp.size == 2 and eng.tp.rank == 0
        assert eng.layout.num_kv_heads == 1  # each rank holds its own KV head
        got = [o.token_ids for o in llm2.generate(prompts, _params())]
        assert got == want
        # rank 1 is a live process holding the other shard
        shapes = eng._tp_workers.call("tests.engine.test_tp:_shard_shapes")
        assert shapes == [_shard_shapes(eng)]
        # a second round reuses the prefix cache on both ranks alike
        again = [o.token_ids for o in llm2.generate(prompts[:2], _params()[:2])]
        assert again == want[:2]
        eng.check_idle()
    finally:
        llm2.engine.close()
    assert all(p.poll() is not None for p in llm2.engine._tp_workers.procs)


def _shard_shapes(engine):
    """Runs on every rank: what this rank's shard looks like."""
    attn = engine.model.layers[0].self_attn
    return (engine.tp.size, attn.num_heads, attn.num_kv_heads, tuple(engine.pool.buffer.shape))


def test_heads_that_do_not_divide_fail_clearly(model_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by 3"):
        LLM(str(model_dir), dtype="float64", device="cpu", tp=3)


def test_tp2_with_overlap_scheduling_matches_tp1(model_dir):
    """Overlap with TP: rank 0 samples on its device and broadcasts the tokens into the
    followers' future rings; every rank resolves the next step's placeholders itself.
    Greedy and seeded sampling, requests ending at different steps, and a logprobs request
    (the synchronous path) in the same run."""
    prompts = PROMPTS + [[3] * 17, [40, 41] * 9]
    params = _params() + [SamplingParams(temperature=0, max_tokens=7, logprobs=2)]
    llm1 = LLM(str(model_dir), dtype="float64", device="cpu", num_threads=1)
    want = [o.token_ids for o in llm1.generate(prompts, params)]
    del llm1
    llm2 = LLM(str(model_dir), dtype="float64", device="cpu", num_threads=1, tp=2, overlap_schedule=True)
    try:
        eng = llm2.engine
        assert eng.overlap is not None
        got = [o.token_ids for o in llm2.generate(prompts, params)]
        assert got == want
        assert eng.overlap.num_sync_steps > 0  # the logprobs request sampled on the host
        again = [o.token_ids for o in llm2.generate(prompts[:3], params[:3])]
        assert again == want[:3]
        eng.check_idle()
    finally:
        llm2.engine.close()


def test_tp2_with_fewer_kv_heads_than_ranks_replicates_them(tmp_path):
    """One KV head, TP=2: both ranks hold that head (its query heads are split over them),
    and greedy tokens equal TP=1's."""
    one_kv = make_tiny_model(tmp_path / "qwen3-kv1", "qwen3", vocab=251, heads=4, kv_heads=1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 8)]
    llm1 = LLM(str(one_kv), dtype="float64", device="cpu", num_threads=1)
    want = [o.token_ids for o in llm1.generate(PROMPTS, params)]
    del llm1
    llm2 = LLM(str(one_kv), dtype="float64", device="cpu", num_threads=1, tp=2)
    try:
        eng = llm2.engine
        assert eng.layout.num_kv_heads == 1 and eng.kv_heads.first == 0
        assert eng._tp_workers.call("tests.engine.test_tp:_kv_head_first") == [0]  # rank 1 holds head 0 too
        assert [o.token_ids for o in llm2.generate(PROMPTS, params)] == want
    finally:
        llm2.engine.close()


def _kv_head_first(engine):
    return engine.kv_heads.first
