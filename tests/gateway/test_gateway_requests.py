"""Request parsing and checks (shared.openai_protocol) and sampling/context budgeting."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_api.request_sampling import chat_sampling, completion_sampling
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import parse_chat_request, parse_completion_request


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_chat_defaults_and_text_parts():
    req = parse_chat_request(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "user", "content": "c"}]}).encode())
    assert req.model is None and not req.stream and req.stop_list == []
    msgs = req.template_messages()
    assert msgs[1] == {"role": "user", "content": "ab"}
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"] == [CALL]


@pytest.mark.parametrize("fields,param", [
    ({"temperature": "0.5"}, "temperature"),   # strict: a string is not a number
    ({"stream": 1}, "stream"),                  # strict: 1 is not a boolean
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"stop": ["a", 1]}, "stop"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": ""}, "stop"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    # an earlier answer's tool calls are checked too (found by tests/gateway/test_gateway_fuzz.py: a 500 before)
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_chat_invalid_fields_name_the_param(fields, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(chat(**fields))
    assert info.value.param == param
    assert info.value.status == 400


def test_unknown_fields_are_ignored():
    req = parse_chat_request(chat(store=False, metadata={"a": "b"}, parallel_tool_calls=True))
    assert req.messages[0].content == "hi"


def test_completion_prompt_forms():
    assert parse_completion_request(b'{"prompt": "x"}').prompts() == ["x"]
    assert parse_completion_request(b'{"prompt": ["x", "y"]}').prompts() == ["x", "y"]
    assert parse_completion_request(b'{"prompt": [1, 2]}').prompts() == [[1, 2]]
    assert parse_completion_request(b'{"prompt": [[1, 2], [3]]}').prompts() == [[1, 2], [3]]
    echo = parse_completion_request(b'{"prompt": "x", "echo": true, "max_tokens": 0, "logprobs": 1}')
    assert echo.echo_only and echo.max_tokens == 1
    for bad in (b'{"prompt": [[1], []]}', b'{"prompt": [-1]}', b'{"prompt": ""}', b'{"prompt": "x", "max_tokens": 0}',
                b'{"prompt": "x", "best_of": 2}', b'{"prompt": "x", "logprobs": 21}'):
        with pytest.raises(InvalidRequest):
            parse_completion_request(bad)
    with pytest.raises(InvalidRequest) as info:  # a float among token ids: the message names every form
        parse_completion_request(b'{"prompt": [1, 2.0]}')
    assert info.value.param == "prompt" and "array of token ids" in info.value.message


def test_sampling_budget_and_mapping():
    req = parse_chat_request(chat(temperature=0, top_logprobs=4, logprobs=True, stop="x", seed=3))
    s = chat_sampling(req, prompt_tokens=10, max_context=100)
    assert (s.temperature, s.max_tokens, s.logprobs, s.stop, s.seed) == (0, 90, 4, ["x"], 3)  # logprobs on, top 4
    with pytest.raises(InvalidRequest) as info:
        chat_sampling(parse_chat_request(chat(max_tokens=91)), prompt_tokens=10, max_context=100)
    assert info.value.code == "context_length_exceeded" and "101 tokens" in info.value.message
    with pytest.raises(InvalidRequest):
        chat_sampling(parse_chat_request(chat()), prompt_tokens=100, max_context=100)
    c = completion_sampling(parse_completion_request(b'{"prompt": "x", "logprobs": 0}'), 95, 100)
    assert (c.max_tokens, c.logprobs) == (5, 0)  # on, no alternatives
    c = completion_sampling(parse_completion_request(b'{"prompt": "x"}'), 10, 100)
    assert (c.max_tokens, c.logprobs) == (16, None)  # off
