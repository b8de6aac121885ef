"""A stream resumed on other engines from the tokens it already streamed (the gateway's
failover: services/gateway/backends/migration.py): the prompt goes in with those tokens as
`output_prefix`, prefilled (split: on a prefill engine whose KV is copied into a decode
engine's reservation; or colocated) and continued. Sampling is keyed on (seed, position), so
the continuation equals the unfaulted run token for token, greedy or seeded at temperature 1
with penalties (which count the given tokens as output), and greedy on a speculating decode
engine; max_tokens counts them once; a grammar goes on in the state of the tokens sent; a stop string across the seam ends the
stream where the unfaulted one ends. Every run ends with every page free."""
from __future__ import annotations

import json

import pytest

from shared.engine.engine import Engine
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, random_prompts, run_engine, with_real_tokenizer

KIND = "llama_tied_gqa2"
PAGE = 4
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_real_tokenizer(tmp_path_factory, KIND, seed=7)


def engine(d, **kw) -> Engine:
    """A small float64 engine; kw: speculation."""
    return Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=PAGE, max_num_batched_tokens=16,
                  kv_cache_memory=8 << 20, **kw)


def fresh(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**vars(params))


def unfaulted(d, prompt, params):
    [out] = run_engine(engine(d), [prompt], fresh(params))
    return out


def resumed_split(d, prompt, params, streamed: list[int], dec: Engine | None = None) -> tuple[list[int], str]:
    """Prefill prompt + streamed on one engine, copy the KV into a decode engine's reservation,
    continue there: the tokens after `streamed`, and the finish reason."""
    pre, dec = engine(d), dec or engine(d)
    rid = pre.add_request(prompt, fresh(params), prefill_only=True, output_prefix=list(streamed))
    first = None
    while pre.has_work:
        for out in pre.step():
            assert out.prefill_done and out.index == 0
            first = out
    held = pre.get(rid)
    kv_tokens = len(prompt) + len(streamed)
    assert held.status is ReqStatus.HELD and held.num_computed == kv_tokens
    assert held.output_ids == list(streamed) + first.token_ids
    n = pre.kv.pages_for(kv_tokens)
    dst = dec.reserve("res", kv_tokens).page_ids
    dec.pool.buffer[dst] = pre.pool.buffer[held.page_ids[:n]]  # the "transfer"
    pre.release_held(rid)
    assert_all_pages_free(pre)
    got, reason = list(first.token_ids), first.finish_reason
    if not first.finished:
        drid = dec.add_prefilled("res", prompt, first.token_ids[0], fresh(params), seed=None,
                                 output_prefix=list(streamed))
        while dec.has_work:
            for out in dec.step():
                assert out.rid == drid
                got += out.token_ids
                reason = out.finish_reason or reason
    else:
        dec.cancel_reservation("res")
    assert_all_pages_free(dec)
    return got, reason


def resumed_colocated(d, prompt, params, streamed: list[int]):
    eng = engine(d)
    rid = eng.add_request(prompt, fresh(params), output_prefix=list(streamed))
    got, reason, text = [], None, None
    while eng.has_work:
        for o in eng.step():
            assert o.rid == rid
            got += o.token_ids
            reason, text = o.finish_reason or reason, o.text if o.text is not None else text
    assert_all_pages_free(eng)
    return got, reason, text


GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=4242, presence_penalty=0.8, frequency_penalty=0.6,
                        repetition_penalty=1.2, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded_with_penalties"])
def test_a_resumed_stream_draws_what_the_unfaulted_run_draws(model_dir, params):
    prompt = random_prompts(1, [9], seed=3)[0]
    full = unfaulted(model_dir, prompt, params)
    assert len(full.token_ids) == params.max_tokens and full.finish_reason == "length"
    for k in (1, 6, 13):  # after the first token, mid-page, one before the end
        tail, reason = resumed_split(model_dir, prompt, params, full.token_ids[:k])
        # max_tokens counts the streamed tokens once: exactly the rest comes, then "length"
        assert tail == full.token_ids[k:] and reason == "length", k
        tail, reason, _ = resumed_colocated(model_dir, prompt, params, full.token_ids[:k])
        assert tail == full.token_ids[k:] and reason == "length", k


def test_a_speculating_decode_worker_goes_on_as_the_unfaulted_run(model_dir):
    """The decode engine drafts with a model of its own (here the target itself, so drafts are
    accepted and verify steps run): its draft's KV covers the streamed tokens too. Greedy only:
    speculation keeps a seeded stream's distribution, not its tokens (docs/ARCHITECTURE.md,
    "Speculative decoding"), with or without a move."""
    params = GREEDY
    prompt = random_prompts(1, [9], seed=3)[0]
    full = unfaulted(model_dir, prompt, params)
    dec = engine(model_dir, speculative_method="draft", speculative_draft_model=str(model_dir),
                 speculative_tokens=3, speculative_min_acceptance=0.0)
    for k in (1, 7):
        tail, reason = resumed_split(model_dir, prompt, params, full.token_ids[:k], dec=dec)
        assert tail == full.token_ids[k:] and reason == "length", k
    assert dec.spec.stats.verify_steps > 0


def test_a_grammar_resumes_in_the_state_of_the_tokens_sent(model_dir):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=60,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    prompt = random_prompts(1, [6], seed=4)[0]
    full = unfaulted(model_dir, prompt, params)
    eng = engine(model_dir)
    text = eng.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "age"} and full.finish_reason == "stop"
    for k in (2, len(full.token_ids) // 2):
        tail, reason = resumed_split(model_dir, prompt, params, full.token_ids[:k])
        assert tail == full.token_ids[k:] and reason == "stop", k


def test_a_stop_string_across_the_seam_ends_where_the_unfaulted_stream_ends(model_dir):
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    prompt = random_prompts(1, [7], seed=5)[0]
    tokens = unfaulted(model_dir, prompt, params).token_ids
    decode = engine(model_dir).tokenizer.decode
    # a seam k whose stop string is the text's last characters before it and the next ones after
    for k in range(3, len(tokens) - 2):
        before, after = decode(tokens[:k]), decode(tokens[:k + 1])
        stop = before[-2:] + after[len(before):len(before) + 2]
        if len(before) >= 2 and len(after) - len(before) >= 2 and stop not in before and after.startswith(before):
            break
    else:
        raise AssertionError("no token boundary of this run carries a two-sided stop string: change the seed")
    with_stop = SamplingParams(**{**vars(params), "stop": [stop]})
    full = unfaulted(model_dir, prompt, with_stop)
    assert full.finish_reason == "stop" and full.stop_reason == stop and full.token_ids == tokens[:k + 1]
    tail, reason, text = resumed_colocated(model_dir, prompt, with_stop, tokens[:k])
    assert tail == [tokens[k]] and reason == "stop"
    assert text == full.text  # the text up to the stop string, the streamed part included


def test_given_tokens_that_leave_nothing_to_sample_are_refused(model_dir):
    eng = engine(model_dir)
    prompt = random_prompts(1, [5], seed=6)[0]
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request(prompt, SamplingParams(max_tokens=3), output_prefix=[1, 2, 3])
    with pytest.raises(ValueError, match="output token ids"):
        eng.add_request(prompt, SamplingParams(max_tokens=8), output_prefix=[1, 10 ** 7])
    assert not eng.has_work
    assert_all_pages_free(eng)
