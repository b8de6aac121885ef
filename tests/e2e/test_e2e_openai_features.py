"""The OpenAI API features end to end through `duet up`, split (1 prefill + 1 decode) and colocated (one
`both` worker), with the official openai client and langchain-openai: structured outputs
over a set of schemas (every answer parses and validates), forced and free tool calls and
the follow-up turn, n > 1, lists of prompts, logit_bias, echo with prompt logprobs, the
Responses API. Greedy answers under a grammar are the same split and colocated, and every
worker ends with no KV in use.

The model is a random-weight one with SmolLM2's tokenizer and chat template
(tests/helpers/openai_features.py): under a grammar its answers must validate whatever the weights."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.helpers import openai_features as features
from tests.helpers.stack import DuetUp, managed, new_log_dir

MODEL = "random-smollm2-vocab"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return features.random_model_dir(tmp_path_factory.mktemp("e2e-features"))


@pytest.fixture(scope="module")
def split(request, model_path):
    with managed(request, DuetUp(new_log_dir("features-split"), "--model", str(model_path)).start()) as stack:
        yield stack


@pytest.fixture(scope="module")
def colocated(request, model_path, split):
    up = DuetUp(new_log_dir("features-both"), "--model", str(model_path), "--both", "1", "--prefill", "0",
                "--decode", "0")
    with managed(request, up.start()) as stack:  # boots while the split stack does
        split.wait_ready()
        yield stack.wait_ready()


@pytest.fixture(scope="module")
def stacks(split, colocated):
    return {"split": split, "colocated": colocated}


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_path))


def idle(stacks):
    for stack in stacks.values():
        stack.wait_idle()


def test_structured_outputs_validate_and_greedy_split_equals_colocated(stacks):
    greedy = {name: features.check_structured_outputs(s.client(), MODEL) for name, s in stacks.items()}
    assert greedy["split"] == greedy["colocated"]
    features.check_bad_schema_is_400(stacks["split"].client(), MODEL)
    for stack in stacks.values():
        features.check_unenforceable_schemas_are_400(stack.client(), MODEL)
    idle(stacks)


def test_tool_calls(stacks):
    for stack in stacks.values():
        features.check_forced_tool_calls(stack.client(), MODEL)
        features.check_tool_conversation(stack.client(), MODEL)
    idle(stacks)


def test_n_prompt_lists_logit_bias_and_echo(stacks, tokenizer):
    for stack in stacks.values():
        client = stack.client()
        features.check_n_and_prompt_lists(client, MODEL)
        features.check_logit_bias(client, MODEL, tokenizer)
        features.check_echo(client, MODEL, tokenizer)
    idle(stacks)


def test_responses_api(stacks):
    for stack in stacks.values():
        features.check_responses(stack.client(), MODEL)
    idle(stacks)


class Forecast(BaseModel):
    """A weather forecast."""
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)
    windy: bool


class GetWeather(BaseModel):
    """Current weather in a city."""
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


def test_langchain_openai_tools_and_structured_output(stacks):
    from langchain_openai import ChatOpenAI
    for stack in stacks.values():
        llm = ChatOpenAI(model=MODEL, base_url=stack.base_url, api_key="duet-test", temperature=0, max_tokens=120,
                         max_retries=0)
        forecast = llm.with_structured_output(Forecast, method="json_schema").invoke("Forecast for Paris?")
        assert isinstance(forecast, Forecast)
        message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris?")
        assert [c["name"] for c in message.tool_calls] == ["GetWeather"]
        GetWeather(**message.tool_calls[0]["args"])
        jsonschema.validate(message.tool_calls[0]["args"], GetWeather.model_json_schema())
        required = llm.bind_tools([GetWeather], tool_choice="any").invoke("Weather in Rome?")
        assert required.tool_calls and all(c["name"] == "GetWeather" for c in required.tool_calls)
        streamed = None
        for chunk in llm.bind_tools([GetWeather], tool_choice="GetWeather").stream("Weather in Oslo?"):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "GetWeather"
        assert json.loads(json.dumps(streamed.tool_calls[0]["args"])) == streamed.tool_calls[0]["args"]
    idle(stacks)


def test_n_sequences_take_one_prefill_and_one_transfer(stacks):
    """n=3 through the split stack: prefill computes the prompt once and sends its pages once;
    decode computes no prompt token (its sequences fork from the transferred pages)."""
    from tests.helpers.stack import wait_until
    split = stacks["split"]
    prefill, decode = split.worker_ids("prefill")[0], split.worker_ids("decode")[0]
    before = {w: split.metrics(w) for w in (prefill, decode)}

    def delta(worker, name, **labels):
        return split.metrics(worker).value(name, **labels) - before[worker].value(name, **labels)
    prompt = "A fresh prompt nobody sent before: the three sequences share its pages."
    r = split.client().completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=1,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    cached = r.usage.prompt_tokens_details.cached_tokens or 0
    wait_until(lambda: delta(decode, "duet_engine_tokens_computed_total", phase="decode") >= 15, 10,
               "decode's computed-token counter")
    assert delta(prefill, "duet_engine_tokens_computed_total", phase="prefill") == r.usage.prompt_tokens - cached
    assert delta(prefill, "duet_kv_transfer_seconds_count") == 1
    assert delta(decode, "duet_kv_transfer_seconds_count") == 1
    assert delta(decode, "duet_engine_tokens_computed_total", phase="prefill") == 0
    assert delta(decode, "duet_engine_tokens_computed_total", phase="decode") == 3 * 5  # after the first tokens
    split.wait_idle()
