"""End to end: the gateway over the real engine (embedded SmolLM2-135M-Instruct, CPU) on a
real uvicorn server, driven by the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from services.gateway.backends.local_engine import LocalBackend
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.openai_schema import validate
from tests.helpers.otlp_receiver import GrpcReceiver, HttpReceiver
from tests.helpers.gateway_support import UvicornThread, free_port, wait_until

MODEL = "smollm2"
CONTEXT = 1024
MESSAGES = [{"role": "user", "content": "Name three colors."}]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    from shared.model_files.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def backend(model_dir):
    def load():
        from shared.engine import Engine, EngineConfig

        return Engine(EngineConfig(model_dir=str(model_dir), max_model_len=CONTEXT))

    return LocalBackend(load, name=MODEL, expected_context_len=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, backend):
    ctx = GatewayContext(backend, PromptBuilder.from_model_dir(model_dir), GatewayMetrics(), MODEL, CONTEXT)
    with UvicornThread(build_app(ctx)) as srv:
        assert backend.wait_loaded(120), f"engine did not load: {backend.load_error}"
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def engine_idle(backend) -> bool:
    def check(engine):
        engine.check_idle()  # no requests, every KV page back (cached prefixes are evictable)
        return True

    try:
        return backend.call(check).result(10)
    except AssertionError:
        return False


def test_greedy_chat_stream_equals_non_stream(client, backend, model_dir):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens <= 6
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, stream=True) if chunk.choices)
    assert streamed == text
    prompt_ids = PromptBuilder.from_model_dir(model_dir).chat_prompt_ids(MESSAGES)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    # The second request shared the first one's prompt: the prefix cache served it.
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert wait_until(lambda: engine_idle(backend), timeout=10)


def test_a_repeated_prompt_keeps_only_its_uncached_tokens_on_the_prefill_budget(client, server):
    """The in-process engine answers what the router answers for the split stack: how much of
    the prompt its cache holds, which the admission takes off the prefill budget; the answer's
    usage reports the same tokens cached."""
    def held() -> float:
        page = httpx.get(server.base_url + "/metrics", timeout=10).text
        return float(next(line.split()[-1] for line in page.splitlines()
                          if line.startswith("duet_gateway_admission_cached_prompt_tokens_total")))

    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    before = held()
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and held() - before == cached, (held() - before, cached)


def test_seeded_sampling_repeats_and_logprobs(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0.9, seed=7, max_tokens=4)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b
    body = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3, "logprobs": True,
        "top_logprobs": 3}).json()
    validate(body, "CreateChatCompletionResponse")
    for entry in body["choices"][0]["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry["logprob"] == pytest.approx(tops[0], abs=1e-5)  # greedy: the sampled token is the best
        assert entry["logprob"] <= 0


def test_stop_string_and_max_tokens_on_completions(client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10)
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 10
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_concurrent_async_requests(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            prompts = ["One", "Two", "Three"]
            results = await asyncio.gather(*(
                client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6) for p in prompts))
            return [r.usage.completion_tokens for r in results]

    assert asyncio.run(run()) == [6, 6, 6]


def test_client_disconnect_aborts_engine_request(server, backend):
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 500,
                "ignore_eos": True}) as response:
            seen = 0
            for line in response.iter_lines():
                seen += '"content":' in line
                if seen == 3:
                    break
    assert wait_until(lambda: engine_idle(backend), timeout=10), "engine still holds the abandoned request"


def test_errors_from_the_real_stack(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_main_serves_with_the_local_backend(model_dir, protocol):
    """`services.gateway.main` as its own process: /health turns 200 once the engine loaded.
    With the standard OTEL_* variables pointing at a real OTLP receiver (gRPC TraceService or
    HTTP POST /v1/traces), the request's server span reaches it while the process runs."""
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"PYTHONPATH": str(REPO), "DUET_PORT": str(port), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    if protocol == "grpc":  # explicit; for http the endpoint alone turns OTLP on (tracing.py)
        env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "gw-otlp-test"})
    service_name = env.get("OTEL_SERVICE_NAME", "duet-gateway")
    with receiver:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from services.gateway.main import main; "
                                 "sys.exit(main(sys.argv[1:]))", "--backend", "local", "--host", "127.0.0.1",
                                 "--served-model-name", "tiny-local", "--max-model-len", "512",
                                 "--log-level", "warning"], cwd=REPO, env=env)
        try:
            base = f"http://127.0.0.1:{port}"

            def healthy() -> bool:
                try:
                    return httpx.get(base + "/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_until(healthy, timeout=120, interval=0.5), "gateway never became healthy"
            models = httpx.get(base + "/v1/models").json()
            assert models["data"][0]["id"] == "tiny-local" and models["data"][0]["max_model_len"] == 512
            with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
                raw = client.completions.with_raw_response.create(model="tiny-local", prompt="Hello", max_tokens=3)
            assert raw.parse().usage.completion_tokens == 3
            request_id = raw.headers["x-request-id"]
            assert "duet_time_to_first_token_seconds" in httpx.get(base + "/metrics").text
            spans = receiver.wait_for(lambda s: s.attributes.get("duet.request_id") == request_id, timeout=20)
            assert len(spans) == 1, f"the request's span never reached the OTLP {protocol} receiver"
            span = spans[0]
            assert span.name == "POST /v1/completions" and span.kind == 2  # SPAN_KIND_SERVER
            assert span.attributes["http.status_code"] == 200
            assert span.resource["service.name"] == service_name
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # uvicorn shuts down gracefully (lifespan closes the backend), then re-raises SIGTERM.
    assert proc.returncode in (0, -15)


def test_default_model_json_object_and_tools(client, backend):
    """SmolLM2 (real weights) under json_object answers a JSON object; with tools and
    tool_choice auto its answer goes through the Hermes-style fallback prompt and parser:
    whatever it says is either text or calls that parse (see the README)."""
    import json

    body = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat with a name and an age, as JSON."}])
    assert body.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(body.choices[0].message.content), dict)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    auto = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30, tools=tools,
                                          messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = auto.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(json.loads(c.function.arguments) is not None for c in choice.message.tool_calls)
    else:
        assert choice.message.content
    print("SmolLM2 with tools (auto):", choice.finish_reason, choice.message.content, choice.message.tool_calls)
    assert wait_until(lambda: engine_idle(backend), timeout=10)


def test_a_model_that_fails_to_load_is_a_503_reason():
    """The loader thread's failure is reported by ready() and by every request, not a hang."""
    from services.gateway.backends.interface import BackendUnavailable, GenerationRequest
    from shared.engine.sampling_params import SamplingParams

    def load():
        raise FileNotFoundError("no weights in /nowhere")

    backend = LocalBackend(load, name=MODEL, expected_context_len=CONTEXT)

    async def scenario():
        await backend.start()
        assert not await asyncio.to_thread(backend.wait_loaded, 10)
        assert backend.max_context_len == CONTEXT
        with pytest.raises(BackendUnavailable, match="failed to load: no weights"):
            async for _ in backend.generate(GenerationRequest("r", [1, 2], SamplingParams())):
                pass
        await backend.close()

    asyncio.run(scenario())
