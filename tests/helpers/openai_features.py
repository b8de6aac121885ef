"""Checks of the OpenAI API features (README, "OpenAI API features") through the official
openai client, shared by the tests that run them against each deployment (the gateway's
in-process engine, `duet up` split and colocated). Every body and stream event is validated
against OpenAI's schemas.

The model is a random-weight one with SmolLM2's real tokenizer and chat template
(`random_model_dir`): its text is noise, but under a grammar every answer must parse and
validate whatever the weights; its chat template knows no tools, so tools go through
Duet's Hermes-style fallback."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from tests.helpers.openai_schema import validate, validate_response_event

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "status": {"enum": ["open", "shipped", "cancelled"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 6},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "gift": {"type": "boolean"}},
        "required": ["id", "status", "items", "address", "gift"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["red", "green", "blue"]}},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}},
        "required": ["tags", "score", "note"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def random_model_dir(root: Path) -> Path:
    """A random-weight Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    from tests.helpers.engine_models import build_model_dir
    from tests.helpers.stack import model_dir as default_model_dir
    path = root / "random-smollm2-vocab"
    if not (path / "config.json").exists():
        build_model_dir(path, "llama_tied_gqa2", seed=9, tokenizer_from=default_model_dir(), vocab_size=49152,
                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return path


def sse_events(response) -> list:
    """(event name or None, parsed data) for each event of a raw streaming response."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            out.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return out


def chat_stream(client, **kw) -> list[dict]:
    """Stream a chat completion; every chunk validated; returns the chunks."""
    with client.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
        events = [data for _, data in sse_events(r)]
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        validate(chunk, "CreateChatCompletionStreamResponse")
    return events[:-1]


def chat_json(client, **kw) -> dict:
    raw = client.chat.completions.with_raw_response.create(**kw)
    body = raw.http_response.json()
    validate(body, "CreateChatCompletionResponse")
    raw.parse()  # the client reads it too
    return body


def assembled(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: content text, tool calls (assembled from deltas), finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            c = out.setdefault(choice["index"], {"content": "", "tool_calls": {}, "finish": None})
            delta = choice["delta"]
            c["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = c["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["name"] = fn.get("name") or slot["name"]
                slot["arguments"] += fn.get("arguments") or ""
            if choice["finish_reason"] is not None:
                c["finish"] = choice["finish_reason"]
    return out


# --- structured outputs ---------------------------------------------------------------

def check_structured_outputs(client, model) -> list[str]:
    """Every schema, greedy and sampled, JSON and SSE: each answer parses and validates.
    Returns the greedy JSON answers (for split/colocated comparisons)."""
    greedy = []
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": f"Give me a {name} as JSON."}]
        body = chat_json(client, model=model, messages=messages, response_format=fmt, temperature=0,
                         max_tokens=200)
        text = body["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), schema)
        assert body["choices"][0]["finish_reason"] == "stop"
        greedy.append(text)
        sampled = chat_json(client, model=model, messages=messages, response_format=fmt, temperature=1.0,
                            seed=5, n=2, max_tokens=200)
        for choice in sampled["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        chunks = chat_stream(client, model=model, messages=messages, response_format=fmt, temperature=0,
                             max_tokens=200)
        assert assembled(chunks)[0]["content"] == text
    return greedy


def check_bad_schema_is_400(client, model) -> None:
    import openai
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}
    try:
        client.chat.completions.create(model=model, messages=ASK, response_format=bad, max_tokens=5)
    except openai.BadRequestError as exc:
        body = exc.response.json()
        validate(body, "ErrorResponse")
        assert body["error"]["message"].startswith("response_format.json_schema.schema: "), body
        assert "minimum greater than maximum" in body["error"]["message"], body
        assert body["error"]["param"] == "response_format"
    else:
        raise AssertionError("a schema xgrammar cannot compile was accepted")


# schemas whose keywords xgrammar would not enforce (the output would break them, or, for
# {"$ref": "#"}, the worker would fail on a grammar nothing fits), with the keyword named
UNENFORCEABLE = {
    "$ref": {"$ref": "#"},
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]},
    "allOf": {"allOf": [{"type": "string"}, {"type": "integer"}]},
}


def check_unenforceable_schemas_are_400(client, model) -> None:
    """Each way a schema comes in (chat response_format, Responses text.format, a forced
    function's parameters): a 400 invalid_request_error naming the keyword and the field."""
    import openai
    for keyword, schema in UNENFORCEABLE.items():
        calls = {
            "response_format": lambda: client.chat.completions.create(
                model=model, messages=ASK, max_tokens=5,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
            "text.format": lambda: client.responses.create(
                model=model, input="hi", max_output_tokens=5,
                text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}),
            "tools[0].function.parameters": lambda: client.chat.completions.create(
                model=model, messages=ASK, max_tokens=5, tool_choice="required", tools=[{"type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema},
                                                         "required": ["x"]}}}]),
        }
        for param, call in calls.items():
            try:
                call()
            except openai.BadRequestError as exc:
                body = exc.response.json()
                validate(body, "ErrorResponse")
                error = body["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == param, body
                assert f"keyword '{keyword}' at $" in error["message"], body
            else:
                raise AssertionError(f"{param}: a schema with {keyword!r} was accepted")


# --- tools -------------------------------------------------------------------------------

def check_forced_tool_calls(client, model) -> None:
    """tool_choice required / named: the grammar makes every call parse, with arguments that
    match the function's schema; streamed as tool-call deltas."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", True), ("required", False), (named, True)):
        body = chat_json(client, model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                         parallel_tool_calls=parallel, temperature=0, max_tokens=150)
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and c["message"]["content"] is None
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        if choice is named:
            assert [call["function"]["name"] for call in calls] == ["get_weather"]
        streamed = assembled(chat_stream(client, model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                         parallel_tool_calls=parallel, temperature=0, max_tokens=150))[0]
        assert streamed["finish"] == "tool_calls"
        assert [(s["name"], json.loads(s["arguments"])) for s in streamed["tool_calls"].values()] == \
            [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def check_tool_conversation(client, model) -> None:
    """The follow-up turn: an assistant message with tool_calls and the `tool` results."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
    body = chat_json(client, model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert body["usage"]["prompt_tokens"] > 0


# --- n, batches, logit_bias, echo ---------------------------------------------------------------

def check_n_and_prompt_lists(client, model) -> None:
    body = chat_json(client, model=model, messages=ASK, n=3, temperature=1.0, seed=3, max_tokens=6)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(set(texts)) > 1
    singles = [chat_json(client, model=model, messages=ASK, temperature=1.0, seed=3 + i, max_tokens=6)
               ["choices"][0]["message"]["content"] for i in range(3)]
    assert texts == singles  # choice i samples with seed + i
    ended = chat_json(client, model=model, messages=ASK, n=2, max_tokens=1, temperature=0)  # both end at once
    assert [c["finish_reason"] for c in ended["choices"]] == ["length", "length"]
    assert ended["usage"]["completion_tokens"] == 2
    chunks = chat_stream(client, model=model, messages=ASK, n=3, temperature=1.0, seed=3, max_tokens=6)
    got = assembled(chunks)
    assert [got[i]["content"] for i in range(3)] == texts and all(got[i]["finish"] for i in range(3))

    prompts = ["The sky is", "Two plus two", "Once upon"]
    raw = client.completions.with_raw_response.create(model=model, prompt=prompts, n=2, max_tokens=4,
                                                      temperature=0)
    body = raw.http_response.json()
    validate(body, "CreateCompletionResponse")
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for k, prompt in enumerate(prompts):  # prompt-major: choices 2k, 2k+1 answer prompt k
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert body["choices"][2 * k]["text"] == body["choices"][2 * k + 1]["text"] == alone.choices[0].text
    assert 0 < body["usage"]["completion_tokens"] <= 6 * 4
    assert body["usage"]["prompt_tokens"] == sum(alone_prompt_tokens(client, model, p) for p in prompts)
    with client.completions.with_streaming_response.create(model=model, prompt=prompts, n=2, max_tokens=4,
                                                           temperature=0, stream=True) as r:
        events = [d for _, d in sse_events(r)]
    assert events[-1] == "[DONE]"
    texts = {}
    for chunk in events[:-1]:
        validate(chunk, "CreateCompletionStreamResponse")
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in body["choices"]]


def alone_prompt_tokens(client, model, prompt) -> int:
    return client.completions.create(model=model, prompt=prompt, max_tokens=1).usage.prompt_tokens


def check_logit_bias(client, model, tokenizer) -> None:
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = chat_json(client, model=model, messages=ASK, logit_bias={str(token): 100}, temperature=0, max_tokens=3)
    assert body["choices"][0]["message"]["content"] == tokenizer.decode([token] * 3)
    first = chat_json(client, model=model, messages=ASK, temperature=0, max_tokens=1)["choices"][0]
    banned = tokenizer.encode(first["message"]["content"], add_special_tokens=False)[0]
    again = chat_json(client, model=model, messages=ASK, logit_bias={str(banned): -100}, temperature=0,
                      max_tokens=1)["choices"][0]["message"]["content"]
    assert again != first["message"]["content"]


def check_echo(client, model, tokenizer) -> None:
    """lm-eval's loglikelihood request: echo + logprobs with max_tokens 0 (and 1)."""
    prompt = "The capital of France is Paris"
    ids = tokenizer.encode(prompt)
    for max_tokens in (0, 1):
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, echo=True, logprobs=2,
                                                          max_tokens=max_tokens, temperature=0)
        body = raw.http_response.json()
        validate(body, "CreateCompletionResponseEcho")
        choice = body["choices"][0]
        assert choice["text"].startswith(prompt) and (max_tokens or choice["text"] == prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
        assert body["usage"]["completion_tokens"] == max_tokens
    plain = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(prompt)


# --- responses -----------------------------------------------------------------------------

def check_responses(client, model) -> None:
    import openai
    raw = client.responses.with_raw_response.create(model=model, input="Say hello.", instructions="Be brief.",
                                                   max_output_tokens=5, temperature=0)
    body = raw.http_response.json()
    validate(body, "Response")
    parsed = raw.parse()
    assert body["status"] in ("completed", "incomplete") and body["usage"]["output_tokens"] <= 5
    assert parsed.output_text == body["output"][0]["content"][0]["text"]
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]
    same = client.responses.create(model=model, input=messages, instructions="Be brief.", max_output_tokens=5,
                                   temperature=0)
    assert same.output_text == parsed.output_text
    with client.responses.with_streaming_response.create(model=model, input="Say hello.", instructions="Be brief.",
                                                         max_output_tokens=5, temperature=0, stream=True) as r:
        events = sse_events(r)
    for name, event in events:
        validate_response_event(event)
        assert name == event["type"]
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta") == parsed.output_text
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    # function tools, forced
    fn = {"type": "function", **WEATHER["function"]}
    forced = client.responses.create(model=model, input="Weather in Paris?", tools=[fn], tool_choice="required",
                                     temperature=0, max_output_tokens=100)
    calls = [o for o in forced.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    with client.responses.with_streaming_response.create(
            model=model, input="Weather in Paris?", tools=[fn], tool_choice="required", temperature=0,
            max_output_tokens=100, stream=True) as r:
        events = sse_events(r)
    for _, event in events:
        validate_response_event(event)
    done = [e for _, e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"]) for e in done] == [json.loads(c.arguments) for c in calls]
    # the follow-up turn, stateless: the call and its output as input items
    follow = client.responses.create(model=model, max_output_tokens=5, temperature=0, tools=[fn], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "{\"temp\": 21}"}])
    assert follow.usage.input_tokens > 0
    structured = client.responses.create(model=model, input="A person, as JSON.", temperature=0,
                                         max_output_tokens=200, text={"format": {
                                             "type": "json_schema", "name": "person",
                                             "schema": SCHEMAS["person"], "strict": True}})
    jsonschema.validate(json.loads(structured.output_text), SCHEMAS["person"])
    try:
        client.responses.create(model=model, input="hi", previous_response_id="resp_123")
    except openai.BadRequestError as exc:
        validate(exc.response.json(), "ErrorResponse")
        assert exc.response.json()["error"]["param"] == "previous_response_id"
    else:
        raise AssertionError("previous_response_id was accepted")
