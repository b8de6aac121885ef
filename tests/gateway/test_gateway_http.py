"""The gateway's HTTP layer over a real uvicorn server, driven by the official openai client
and by raw HTTP (to check every byte sent against OpenAI's own schemas).

The backend here is a ScriptedBackend (exact control over tokens, refusals, failures and
timing); tests/gateway/test_gateway_local_engine.py runs the same server over the real engine.
"""

from __future__ import annotations


import httpx
import openai
import pytest

from services.gateway.backends.interface import BackendBusy, BackendUnavailable
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from shared.process_pool.pool import ProcessPool
from tests.helpers.openai_schema import validate
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir, sse_data, wait_until

MODEL = "tiny"
CONTEXT = 256
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT))


@pytest.fixture(scope="module")
def backend(prompts):
    return ScriptedBackend(script=[], eos_token_id=prompts.tokenizer.eos_token_id, max_context_len=CONTEXT)


@pytest.fixture(scope="module")
def server(prompts, backend):
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT)
    with UvicornThread(build_app(ctx)) as srv:
        yield srv


@pytest.fixture
def scripted(backend, prompts):
    """Reset the shared backend and return a function that sets its reply text."""
    backend.delay_s = 0.0
    backend.tokens_per_event = 1
    backend.refuse = None
    backend.fail_after_tokens = None
    backend.fail_with = None
    backend.is_ready = True
    backend.requests.clear()
    backend.cancelled.clear()
    backend.finished.clear()

    def reply(text: str) -> list[int]:
        backend.script = prompts.tokenizer.encode(text, add_special_tokens=False)
        return backend.script

    reply("Hello there!")
    return reply


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def stream_events(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_data(response.iter_lines())


# --- chat completions -----------------------------------------------------------------


def test_chat_completion_with_openai_client(client, scripted, prompts, backend):
    scripted("Hello there!")
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50)
    assert result.choices[0].message.content == "Hello there!"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason == "stop"
    prompt_ids = prompts.chat_prompt_ids(MESSAGES)
    assert backend.requests[-1].prompt_token_ids == prompt_ids
    assert prompts.tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")  # generation prompt
    usage = result.usage
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == len(backend.script) + 1  # + EOS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_chat_completion_json_matches_openai_schema(http, scripted):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    body = response.json()
    validate(body, "CreateChatCompletionResponse")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert response.headers["x-request-id"] == body["id"]


def test_chat_stream_chunks_match_schema_and_join_to_the_text(http, scripted):
    scripted("你好世界 😀🎉 café")
    events = stream_events(http, "/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == "你好世界 😀🎉 café"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_with_openai_client(client, scripted):
    scripted("Streaming works.")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == "Streaming works."
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_stop_string_is_trimmed_and_generation_cancelled(client, http, scripted, backend):
    scripted("The answer is 42. STOP here. The end.")
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["STOP", "never"])
    assert result.choices[0].message.content == "The answer is 42. "
    assert result.choices[0].finish_reason == "stop"
    # The gateway closed the backend stream at the stop string: not run to the end.
    assert backend.requests[-1].request_id in backend.cancelled
    assert backend.requests[-1].sampling.stop == ["STOP", "never"]

    # Streaming: nothing of the stop string leaks, even a held-back partial "S"/"ST".
    scripted("The answer is 42. STOP here.")
    events = stream_events(http, "/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "stream": True, "stop": "STOP"})
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(pieces) == "The answer is 42. "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_prefix_that_is_not_a_stop_is_released(client, scripted):
    scripted("a STOP-less STORY")
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop="STOPPED")
    assert result.choices[0].message.content == "a STOP-less STORY"


def test_max_tokens_gives_length(client, scripted, backend):
    scripted("one two three four five six seven")
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3,
                                            max_tokens=7)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 3
    assert backend.requests[-1].sampling.max_tokens == 3  # max_completion_tokens wins


def test_sampling_fields_and_extensions_reach_the_backend(client, scripted, backend):
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.7, top_p=0.9, seed=1234, frequency_penalty=0.5,
        presence_penalty=-0.5, max_tokens=20,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "stop_token_ids": [7, 8]})
    s = backend.requests[-1].sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_p, s.repetition_penalty) == (0.7, 0.9, 1234, 40, 0.05, 1.1)
    assert (s.frequency_penalty, s.presence_penalty, s.ignore_eos, s.stop_token_ids) == (0.5, -0.5, True, [7, 8])
    assert s.max_tokens == 20 and s.logprobs is None
    # Without max_tokens, chat may use the rest of the context.
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    req = backend.requests[-1]
    assert req.sampling.max_tokens == CONTEXT - len(req.prompt_token_ids)
    assert req.trace_context == {} or "traceparent" in req.trace_context


def test_chat_logprobs(http, scripted, prompts):
    text = "café 😀"
    scripted(text)
    body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "logprobs": True,
                                                    "top_logprobs": 3}).json()
    validate(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    assert content[0]["logprob"] == -0.25
    # Raw bytes of the generated tokens (EOS excluded) rebuild the text exactly.
    raw = bytes(b for entry in content[:-1] for b in entry["bytes"])
    assert raw.decode("utf-8") == text
    assert any(entry["token"].startswith("bytes:") for entry in content), "a split emoji byte token"

    events = stream_events(http, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True,
                                                          "logprobs": True, "top_logprobs": 2})
    streamed = [lp for e in events[:-1] for ch in e["choices"] if ch["logprobs"] for lp in ch["logprobs"]["content"]]
    for e in events[:-1]:
        validate(e, "CreateChatCompletionStreamResponse")
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in content]


# --- completions ----------------------------------------------------------------------


def test_completion_with_openai_client(client, scripted, prompts, backend):
    scripted(" world, the end")
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40)
    assert result.choices[0].text == " world, the end"
    assert result.choices[0].finish_reason == "stop"
    assert backend.requests[-1].prompt_token_ids == prompts.text_prompt_ids("Hello")
    assert result.usage.prompt_tokens == len(prompts.text_prompt_ids("Hello"))


def test_completion_default_max_tokens_is_16(client, scripted, backend):
    scripted("x " * 40)
    result = client.completions.create(model=MODEL, prompt="Hello")
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 16


def test_completion_token_prompt_stream_and_logprobs(http, scripted, backend):
    scripted("one two")
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "logprobs": 2}).json()
    validate(body, "CreateCompletionResponse")
    assert backend.requests[-1].prompt_token_ids == [5, 6, 7]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"]
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    events = stream_events(http, "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7]], "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        validate(e, "CreateCompletionStreamResponse")
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "one two"
    assert events[-2]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]
    assert [c["finish_reason"] for e in events[:-2] for c in e["choices"]][-1] == "stop"


def test_completion_stream_with_openai_client(client, scripted):
    scripted(" and 天气 done")
    text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hi", stream=True,
                                                                         max_tokens=50) if c.choices)
    assert text == " and 天气 done"


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 10_000}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["ok", 3]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 300}, "prompt"),
])
def test_invalid_requests_are_400_in_openai_format(http, scripted, backend, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    validate(error, "ErrorResponse")
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    assert backend.requests == [], "an invalid request must not reach the backend"


def test_context_length_error_code(http, scripted):
    error = http.post("/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": CONTEXT}).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]


def test_bad_json_and_non_object_bodies(http, scripted):
    for raw in (b"{not json", b"[1, 2]", b""):
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400
        validate(response.json(), "ErrorResponse")


def test_unknown_model_is_404_model_not_found(client, http, scripted):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    response = http.get("/v1/models/gpt-17")
    assert response.status_code == 404
    validate(response.json(), "ErrorResponse")


def test_openai_client_raises_bad_request(client, scripted):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert info.value.param == "temperature"


@pytest.mark.parametrize("stream", [False, True])
def test_backend_refusal_maps_to_429_and_503(client, http, scripted, backend, stream):
    backend.refuse = BackendBusy("no free KV pages on decode workers", retry_after_s=2)
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": stream})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    validate(response.json(), "ErrorResponse")
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)

    backend.refuse = BackendUnavailable("no decode workers registered")
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    assert response.status_code == 503
    validate(response.json(), "ErrorResponse")
    assert "no decode workers" in response.json()["error"]["message"]


def test_error_after_stream_started_is_an_sse_error_event(client, http, scripted, backend):
    scripted("one two three four five six")
    backend.fail_after_tokens = 2
    backend.fail_with = BackendUnavailable("decode worker died")
    events = stream_events(http, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True})
    assert events[-1] != "[DONE]"
    validate(events[-1], "ErrorResponse")
    assert "decode worker died" in events[-1]["error"]["message"]
    for e in events[:-1]:
        validate(e, "CreateChatCompletionStreamResponse")
    with pytest.raises(openai.APIError, match="decode worker died"):
        for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
            pass


def test_unknown_route_is_openai_404(http):
    response = http.get("/v1/nothing")
    assert response.status_code == 404
    validate(response.json(), "ErrorResponse")


# --- client disconnects -------------------------------------------------------------


def test_stream_disconnect_cancels_backend_work(server, scripted, backend):
    scripted("word " * 200)
    backend.delay_s = 0.02
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 200}) as response:
            seen = 0
            for line in response.iter_lines():
                seen += '"content":' in line
                if seen == 3:
                    break
            assert seen == 3
        # leaving the block closes the connection mid-stream
    request_id = backend.requests[-1].request_id
    assert wait_until(lambda: request_id in backend.cancelled, timeout=5), "backend work was not cancelled"
    assert request_id not in backend.finished


def test_non_stream_disconnect_cancels_backend_work(server, scripted, backend):
    scripted("word " * 200)
    backend.delay_s = 0.02
    with httpx.Client(base_url=server.base_url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 200})
    assert wait_until(lambda: backend.requests and backend.requests[-1].request_id in backend.cancelled, timeout=5)
    assert not backend.finished


def test_disconnect_while_waiting_for_admission(server, scripted, backend):
    """The client leaves while the request waits before its first token (e.g. for KV room)."""
    scripted("late")
    backend.delay_s = 3.0
    with httpx.Client(base_url=server.base_url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True})
    assert wait_until(lambda: backend.requests and backend.requests[-1].request_id in backend.cancelled, timeout=2.5)


# --- models, health, metrics ----------------------------------------------------------


def test_models_list(client, http):
    body = http.get("/v1/models").json()
    validate(body, "ListModelsResponse")
    assert [m.id for m in client.models.list()] == [MODEL]
    model = http.get(f"/v1/models/{MODEL}").json()
    validate(model, "Model")
    assert model["max_model_len"] == CONTEXT


def test_health_follows_backend_readiness(http, scripted, backend):
    backend.is_ready = False
    response = http.get("/health")
    assert response.status_code == 503
    validate(response.json(), "ErrorResponse")
    backend.is_ready = True
    assert wait_until(lambda: http.get("/health").status_code == 200, 60)  # and the template helper's


def test_health_waits_for_the_chat_template_helper(prompts, backend, scripted, tmp_path):
    """Ready only once a chat-template helper has started (the app starts one): a first chat
    request on a busy node must not wait for its interpreter and imports. A helper that
    cannot start keeps /health at 503 saying why, and is tried again."""
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT)
    flag = tmp_path / "ready"
    ctx.renderer.pool.close()
    ctx.renderer.pool = ProcessPool("chat-template", "tests.helpers.pool_targets:setup_once_exists", (str(flag),))
    with UvicornThread(build_app(ctx, manage_backend=False)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as http:
        assert wait_until(lambda: ctx.renderer.pool.start_error is not None, 60)
        response = http.get("/health")
        assert response.status_code == 503, response.text
        validate(response.json(), "ErrorResponse")
        assert "chat template helper process could not start" in response.json()["error"]["message"]
        flag.touch()
        assert wait_until(lambda: http.get("/health").status_code == 200, 60)


def test_metrics(http, client, scripted):
    def sample(text: str, name: str, **labels) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
            if line.startswith(name + " ") and not want:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = http.get("/metrics").text
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    ep = {"endpoint": "chat_completions"}
    delta = lambda name, **labels: sample(text, name, **labels) - sample(before, name, **labels)  # noqa: E731
    assert delta("duet_requests_total", service="gateway", outcome="ok", status="200", **ep) == 1
    assert delta("duet_requests_total", service="gateway", outcome="rejected", status="400", **ep) == 1
    assert delta("duet_time_to_first_token_seconds_count", **ep) == 1
    assert delta("duet_inter_token_latency_seconds_count", **ep) == result.usage.completion_tokens - 1
    assert delta("duet_prompt_tokens_total", **ep) == result.usage.prompt_tokens
    assert delta("duet_generation_tokens_total", **ep) == result.usage.completion_tokens
    assert sample(text, "duet_gateway_inflight_requests", **ep) == 0
