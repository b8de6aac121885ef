"""The engine's side of the OpenAI API features on a random-weight model with the real
SmolLM2 tokenizer: grammar-constrained decoding (plain loop, overlap loop, split prefill ->
decode), n > 1 sequences sharing one prefill, logit_bias and prompt logprobs. Every run ends
with every page free."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.grammar import GrammarError
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (assert_all_pages_free, hf_logits, load_hf, random_prompts, run_engine,
                                         with_real_tokenizer)

KIND = "llama_tied_gqa2"
PAGE = 4
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False}

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_real_tokenizer(tmp_path_factory, KIND, seed=5)


def engine(d, **kw) -> Engine:
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=PAGE, max_num_batched_tokens=16,
                kv_cache_memory=8 << 20)
    opts.update(kw)
    return Engine(**opts)


def schema_params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=80, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)), **kw)


def texts(eng, results) -> list[str]:
    return [eng.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]


def split_run(pre: Engine, dec: Engine, prompt, params: SamplingParams):
    """Prefill on `pre`, copy the KV into a reservation on `dec`, decode there: outputs by index."""
    rid = pre.add_request(prompt, params, prefill_only=True)
    firsts = {}
    while pre.has_work:
        for out in pre.step():
            assert out.prefill_done
            firsts[out.index] = out
    held = pre.get(rid)
    assert held.status is ReqStatus.HELD
    n = pre.kv.pages_for(len(prompt))
    dst = dec.reserve("res", len(prompt)).page_ids
    dec.pool.buffer[dst] = pre.pool.buffer[held.page_ids[:n]]
    pre.release_held(rid)
    assert_all_pages_free(pre)
    got = {i: list(o.token_ids) for i, o in firsts.items()}
    live = {i for i, o in firsts.items() if not o.finished}
    drid = dec.add_prefilled("res", prompt, [firsts[i].token_ids[0] for i in range(params.n)],
                             SamplingParams(**vars(params)), seed=None)
    if not live:
        assert not dec.is_live(drid)
    while dec.has_work:
        for out in dec.step():
            assert out.rid == drid
            got[out.index].extend(out.token_ids)
    assert_all_pages_free(dec)
    return [got[i] for i in range(params.n)]


def test_json_schema_output_validates_plain_overlap_and_split(model_dir):
    prompts = random_prompts(3, [5, 11, 8], seed=3)
    plain = engine(model_dir)
    results = run_engine(plain, prompts, schema_params())
    for text, r in zip(texts(plain, results), results):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert r.finish_reason == "stop"
    assert plain.grammars.compiles == 1  # one schema, compiled once
    assert_all_pages_free(plain)
    overlap = engine(model_dir, overlap_schedule=True)
    assert [r.token_ids for r in run_engine(overlap, prompts, schema_params())] == [r.token_ids for r in results]
    assert_all_pages_free(overlap)
    pre, dec = engine(model_dir), engine(model_dir, overlap_schedule=True)
    assert split_run(pre, dec, prompts[1], schema_params()) == [results[1].token_ids]


def test_seeded_sampling_under_a_grammar_is_the_same_split(model_dir):
    prompt = random_prompts(1, [9], seed=4)[0]
    params = schema_params(temperature=1.0, seed=11, n=3)
    colocated = run_engine(engine(model_dir, overlap_schedule=True), [prompt], params)
    pre, dec = engine(model_dir), engine(model_dir)
    split = split_run(pre, dec, prompt, params)
    eng = engine(model_dir)
    for i, toks in enumerate(split):
        single = run_engine(eng, [prompt], schema_params(temperature=1.0, seed=11 + i))[0]
        assert toks == single.token_ids  # sequence i draws with seed + i
        jsonschema.validate(json.loads(eng.tokenizer.decode(toks, skip_special_tokens=True)), SCHEMA)
    assert sorted(sum(split, [])) == sorted(colocated[0].token_ids)  # run_engine merges the n sequences


@pytest.mark.parametrize("prompt_len", [8, 10])  # the prompt ends on a page boundary, or inside one
@pytest.mark.parametrize("overlap", [False, True])
def test_n_sequences_share_one_prefill(model_dir, prompt_len, overlap):
    prompt = random_prompts(1, [prompt_len], seed=6)[0]
    eng = engine(model_dir, overlap_schedule=overlap)
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=9, ignore_eos=True)
    rid = eng.add_request(prompt, params)
    seqs: dict[int, list[int]] = {}
    finished = []
    while eng.has_work:
        for out in eng.step():
            assert out.rid == rid
            seqs.setdefault(out.index, []).extend(out.token_ids)
            finished.append(out.request_finished)
    assert finished.count(True) == 1 and finished[-1]
    assert eng.stats.prefill_tokens_computed == prompt_len  # the prompt was computed once
    assert_all_pages_free(eng)
    for i in range(4):
        alone = run_engine(engine(model_dir), [prompt], SamplingParams(temperature=1.0, seed=7 + i,
                                                                       max_tokens=9, ignore_eos=True))[0]
        assert seqs[i] == alone.token_ids, i
    assert len({tuple(s) for s in seqs.values()}) > 1


def test_abort_of_an_n_request_frees_every_sequence(model_dir):
    eng = engine(model_dir, enable_prefix_cache=False)  # forks copy every page then
    prompt = random_prompts(1, [10], seed=8)[0]
    rid = eng.add_request(prompt, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.is_live(rid) and len(eng.requests) == 3
    out = eng.abort(rid)
    assert out.request_finished and out.finish_reason == "abort"
    assert not eng.is_live(rid)
    assert_all_pages_free(eng)


def test_logit_bias_forces_and_bans_tokens(model_dir):
    eng = engine(model_dir)
    prompts = random_prompts(2, [6, 9], seed=9)
    forced = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=5, logit_bias={300: 100.0}))
    assert all(r.token_ids == [300] * 5 for r in forced)
    free = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=5))
    banned = free[0].token_ids[0]
    again = run_engine(eng, prompts[:1], SamplingParams(temperature=0.0, max_tokens=5,
                                                        logit_bias={banned: -100.0}))
    assert banned not in again[0].token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request(prompts[0], SamplingParams(logit_bias={10 ** 6: 1.0}))
    assert_all_pages_free(eng)


def test_prompt_logprobs_equal_transformers(model_dir):
    prompt = random_prompts(1, [13], seed=10)[0]
    eng = engine(model_dir, max_num_batched_tokens=5)  # several chunks
    run_engine(eng, [prompt], SamplingParams(max_tokens=2))  # a cached prefix must not hide positions
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0.0))
    got = None
    while eng.has_work:
        for out in eng.step():
            if out.rid == rid and out.prompt_logprobs is not None:
                got = out.prompt_logprobs
    ref = hf_logits(load_hf(model_dir, torch.float64), prompt).log_softmax(-1)
    assert got[0] is None and len(got) == len(prompt)
    for pos in range(1, len(prompt)):
        lp, top = got[pos]
        assert abs(lp - ref[pos - 1, prompt[pos]].item()) < 1e-4  # float32 log_softmax
        values, ids = ref[pos - 1].topk(2)
        assert [t for t, _ in top] == ids.tolist()
    assert_all_pages_free(eng)


def test_a_bad_schema_is_a_clear_error(model_dir):
    eng = engine(model_dir)
    with pytest.raises(GrammarError, match="minimum greater than maximum"):
        eng.add_request([20, 21], SamplingParams(grammar=GrammarSpec(
            "json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 1}))))
    assert not eng.requests


def test_grammar_cache_size_bounds_the_compiled_grammars(model_dir):
    eng = engine(model_dir, grammar_cache_size=2)
    specs = [GrammarSpec("json_schema", json.dumps({"type": "integer", "maximum": m})) for m in range(3)]
    for spec in specs + specs[2:]:
        eng.grammars.compile(spec)
    assert eng.grammars.compiles == 3  # the third spec twice: cached
    eng.grammars.compile(specs[0])  # evicted by the third
    assert eng.grammars.compiles == 4


def test_overlap_mixes_constrained_free_and_penalised_requests_like_plain(model_dir):
    prompts = random_prompts(4, [6, 9, 12, 7], seed=12)
    params = [schema_params(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5, max_tokens=12, ignore_eos=True),
              schema_params(temperature=0.9, seed=4, logit_bias={30: 2.0})]
    plain = run_engine(engine(model_dir), prompts, params)
    overlap = engine(model_dir, overlap_schedule=True)
    assert [r.token_ids for r in run_engine(overlap, prompts, params)] == [r.token_ids for r in plain]
    for r in (plain[0], plain[3]):
        jsonschema.validate(json.loads(overlap.tokenizer.decode(r.token_ids, skip_special_tokens=True)), SCHEMA)
    assert_all_pages_free(overlap)


def test_decode_recompute_of_an_n_request_forks_after_the_prompt(model_dir):
    """Decode whose KV never arrived recomputes the prompt, then forks the sequences from
    the first tokens prefill reported (not reported again); the rest equals the transfer path."""
    prompt = random_prompts(1, [10], seed=13)[0]
    params = schema_params(temperature=1.0, seed=21, n=3)
    pre, dec = engine(model_dir), engine(model_dir)
    transferred = split_run(pre, dec, prompt, params)
    eng = engine(model_dir, overlap_schedule=True)
    rid = eng.add_request(prompt, SamplingParams(**vars(params)), output_prefix=[t[0] for t in transferred])
    got = {i: [t[0]] for i, t in enumerate(transferred)}
    while eng.has_work:
        for out in eng.step():
            got[out.index].extend(out.token_ids)
    assert [got[i] for i in range(3)] == transferred
    assert not eng.is_live(rid)
    assert_all_pages_free(eng)


def _by_index(eng, prompt, params) -> dict[int, list[int]]:
    eng.add_request(prompt, params)
    seqs: dict[int, list[int]] = {}
    while eng.has_work:
        for out in eng.step():
            seqs.setdefault(out.index, []).extend(out.token_ids)
    return seqs


def test_tensor_parallel_ranks_fork_the_same_pages(tmp_path):
    """With TP=2 the last prompt page is copied on rank 1 too (call_followers): the n
    sequences are TP=1's."""
    from tests.helpers.tiny_models import make_tiny_model
    d = make_tiny_model(tmp_path / "qwen3", "qwen3", vocab=251, heads=4, kv_heads=2)
    prompt, params = list(range(20, 33)), SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=8, ignore_eos=True)
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", num_threads=1, page_size=4)
    want = _by_index(Engine(**opts), prompt, params)
    eng = Engine(tp_size=2, **opts)
    try:
        assert _by_index(eng, prompt, params) == want
        eng.check_idle()
    finally:
        eng.close()
