"""Speculative decoding end to end on the CPU with real processes and the embedded model (greedy,
float32): a decode worker speculating with n-gram lookup behind a plain prefill worker
(1P1D), then a colocated worker with n-gram lookup, then one with the embedded model as
its own draft model. Copy and light-edit requests give exactly the offline engine's text
without speculation; the workers' duet_spec_* metrics show at least two tokens accepted
per verify step (n-gram on copies) and every draft accepted (the model as its own draft);
structured output and n > 1 come out as without speculation."""
from __future__ import annotations

import json
import signal

import pytest

from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, offline_llm

PARAGRAPH = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
             "brass lantern and a notebook in which he recorded the colour of the sea, the direction of the "
             "wind and the names of the ships that passed the rocky point before the night fell.")
COPY = f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}"
EDIT = f"Rewrite the following paragraph, changing 'lighthouse keeper' to 'fisherman':\n\n{PARAGRAPH}"
NGRAM = ["--speculative-method", "ngram", "--speculative-tokens", "4"]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def reference(tokenizer):
    """What the offline engine answers without speculation."""
    from shared.engine import SamplingParams
    from shared.engine.grammar_spec import GrammarSpec
    llm = offline_llm(model_dir())
    out = {}
    for name, content in (("copy", COPY), ("edit", EDIT)):
        out[name] = llm.generate([chat_ids(tokenizer, content)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text
    schema = json.dumps(SCHEMA)
    out["json"] = llm.generate([chat_ids(tokenizer, JSON_ASK)], SamplingParams(
        temperature=0, max_tokens=60, grammar=GrammarSpec("json_schema", schema)))[0].text
    out["n2"] = sorted(o.text for o in _n2(llm, chat_ids(tokenizer, COPY)))
    return out


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ships": {"type": "integer"}},
          "required": ["name", "ships"], "additionalProperties": False}
JSON_ASK = f"Answer in JSON with the keeper's name and how many ships he counted.\n\n{PARAGRAPH}"


def _n2(llm, ids):
    """n = 2 at temperature 1, seed 7: the offline engine forks sequences seeded 7 and 8."""
    from shared.engine import SamplingParams
    outs = []
    for s in (7, 8):
        outs += llm.generate([ids], SamplingParams(temperature=1.0, seed=s, max_tokens=30))
    return outs


def chat(stack, content: str, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return stack.client().chat.completions.create(
        model=model_dir().name, messages=[{"role": "user", "content": content}], **kw)


def accepted_per_step(stack, worker_id: str, method: str) -> tuple[float, float, float]:
    m = stack.metrics(worker_id)
    steps = m.value("duet_spec_verify_steps_total", method=method)
    acc = m.value("duet_spec_accepted_tokens_total", method=method)
    drafted = m.value("duet_spec_draft_tokens_total", method=method)
    return steps, acc, drafted


def check_requests(stack, reference, worker_id: str):
    for name, content in (("copy", COPY), ("edit", EDIT)):
        assert chat(stack, content).choices[0].message.content == reference[name], name
    steps, acc, _ = accepted_per_step(stack, worker_id, "ngram")
    assert steps > 0 and acc / steps >= 2.0, (steps, acc)
    got = chat(stack, JSON_ASK, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "keeper", "schema": SCHEMA}}).choices[0].message.content
    assert got == reference["json"]
    json.loads(got)
    # n > 1 with a seed: the n-gram drafts are point masses, so sampling is token-identical
    res = chat(stack, COPY, n=2, temperature=1.0, seed=7, max_tokens=30)
    assert sorted(c.message.content for c in res.choices) == reference["n2"]


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("spec"), kv_cache_memory="96M")
    with managed(request, s):
        s.start_redis()
        s.start_router()
        s.add_worker("prefill", "prefill-0")
        s.add_worker("decode", "decode-0", NGRAM)
        s.start_gateway()
        s.wait_ready()
        yield s


def test_split_decode_worker_speculates(stack, reference):
    check_requests(stack, reference, "decode-0")
    assert not stack.metrics("prefill-0").has("duet_spec_verify_steps_total")


def test_colocated_worker_speculates(stack, reference):
    for wid in ("prefill-0", "decode-0"):
        stack.kill(wid, signal.SIGTERM)
        stack.procs[wid].popen.wait(60)
    stack.add_worker("both", "both-0", NGRAM)
    stack.wait_registered(["both-0"])
    check_requests(stack, reference, "both-0")


def test_own_draft_model_accepts_every_token(stack, reference):
    stack.kill("both-0", signal.SIGTERM)
    stack.procs["both-0"].popen.wait(60)
    stack.add_worker("both", "both-1", ["--speculative-method", "draft", "--speculative-tokens", "4",
                                        "--speculative-draft-model", str(model_dir())])
    stack.wait_registered(["both-1"])
    assert chat(stack, EDIT).choices[0].message.content == reference["edit"]
    steps, acc, drafted = accepted_per_step(stack, "both-1", "draft")
    assert drafted > 0 and acc == drafted, (steps, acc, drafted)
