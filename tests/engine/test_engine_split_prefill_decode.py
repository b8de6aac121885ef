"""The engine's halves of disaggregated serving, in one process: a prefill engine makes the
first token and holds its pages, the KV is copied into pages a decode engine reserved, and
the decode engine finishes the request. Tokens equal the colocated run (greedy: HF's; seeded
sampling with penalties: the same engine run colocated), and both pools end with every page
free."""
from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (assert_all_pages_free, build_model_dir, hf_greedy, load_hf,
                                 random_prompts, run_engine)

KIND = "qwen3_headdim32"
KV = 4 << 20


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("split") / KIND, KIND, seed=61)


def engines(d):
    kw = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=8, kv_cache_memory=KV)
    return Engine(**kw), Engine(**kw)


def split_run(pre: Engine, dec: Engine, prompts, params: SamplingParams) -> list[list[int]]:
    """Prefill all prompts on `pre`, move their KV into reservations on `dec`, decode there."""
    rids = [pre.add_request(p, params, prefill_only=True) for p in prompts]
    first: dict[str, int] = {}
    while pre.has_work:
        for out in pre.step():
            assert out.prefill_done and not out.finished
            first[out.rid] = out.token_ids[0]
    dec_rids = []
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        held = pre.get(rid)
        assert held.status is ReqStatus.HELD and held.num_computed == len(p)
        # a prefill's queue and compute spans: when a step first computed for it, in how many chunks
        assert held.arrival <= held.scheduled_at and held.prefill_chunks >= -(-len(p) // 8)
        n = pre.kv.pages_for(len(p))
        dst = dec.reserve(f"res-{i}", len(p)).page_ids
        assert len(dst) == n
        dec.pool.buffer[dst] = pre.pool.buffer[held.page_ids[:n]]  # the "transfer"
        assert pre.kv_usage > 0
        pre.release_held(rid)
        dec_rids.append(dec.add_prefilled(f"res-{i}", p, first[rid], params.__class__(**vars(params)),
                                          seed=held.seed))
    assert_all_pages_free(pre)
    got = {rid: [first[r]] for rid, r in zip(dec_rids, rids)}
    joined = [dec.get(r) for r in dec_rids]
    assert all(r.scheduled_at is None for r in joined)  # joined with its KV in place: no step yet
    while dec.has_work:
        for out in dec.step():
            got[out.rid].extend(out.token_ids)
    assert_all_pages_free(dec)
    assert all(r.arrival <= r.scheduled_at and r.prefill_chunks == 0 for r in joined)  # its first decode step
    return [got[r] for r in dec_rids]


def test_split_greedy_equals_hf(model_dir):
    pre, dec = engines(model_dir)
    prompts = random_prompts(4, [5, 18, 3, 27], seed=62)
    got = split_run(pre, dec, prompts, SamplingParams(temperature=0.0, max_tokens=10))
    hf = load_hf(model_dir, torch.float64)
    assert got == [hf_greedy(hf, p, 10) for p in prompts]


def test_split_seeded_sampling_with_penalties_equals_colocated(model_dir):
    prompts = random_prompts(3, [7, 13, 22], seed=63)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=2024, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.1, max_tokens=15, ignore_eos=True)
    colocated = run_engine(engines(model_dir)[0], prompts, params)
    pre, dec = engines(model_dir)
    assert split_run(pre, dec, prompts, params) == [c.token_ids for c in colocated]


def test_reservations_cancel_and_first_token_finishes(model_dir):
    pre, dec = engines(model_dir)
    cap = dec.kv.capacity
    pages = dec.reserve("r", 10).page_ids
    assert len(pages) == 3 and dec.kv.allocator.num_free == cap - 3 and dec.kv_usage > 0
    with pytest.raises(AssertionError, match="page leak: 3 pages"):
        dec.check_idle()
    assert dec.cancel_reservation("r") and not dec.cancel_reservation("r")
    assert_all_pages_free(dec)
    assert dec.kv.allocator.num_free == cap
    # a first token that already ends the request (max_tokens=1): pages back at once
    dec.reserve("r2", 6)
    dec.add_prefilled("r2", [20, 21, 22, 23, 24, 25], 30, SamplingParams(max_tokens=1), seed=1)
    assert not dec.has_work
    assert_all_pages_free(dec)
    # a prefill-only request that is aborted while held gives its pages back too
    rid = pre.add_request([40, 41, 42, 43, 44], SamplingParams(max_tokens=5), prefill_only=True)
    while pre.has_work:
        pre.step()
    assert pre.get(rid).status is ReqStatus.HELD and pre.kv_usage > 0
    assert pre.abort(rid) is None
    assert_all_pages_free(pre)
