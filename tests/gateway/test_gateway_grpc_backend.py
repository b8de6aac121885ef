"""The gateway's gRPC backend (route, reserve on decode, prefill, decode stream, release)
through a real uvicorn server, the real Router over a real Redis registry, and real gRPC to
Prefill/Decode servicers.

The prefill and decode servicers here are scripted stand-ins that speak duet.proto (the
engine-backed workers are tested on their own); they record every call, cancellation and
reservation so the tests can check what the gateway owes them: reservation cancelled
when the first token ends the request, RPCs cancelled when the client leaves, router
load released on every path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
import time

import grpc
import httpx
import openai
import pytest

from protos import duet_pb2, duet_pb2_grpc
from services.decode.stream_mux import GenerateStreamsServicer
from services.gateway.backends.grpc_workers import GrpcBackend, GrpcBackendConfig
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from shared.registry.worker_info import WorkerInfo, WorkerLoad
from tests.helpers.openai_schema import validate
from tests.helpers.stack import Metrics
from tests.helpers.gateway_support import (LoopThread, RouterCluster, UvicornThread, byte_level_tokenizer_dir,
                                           in_memory_spans, wait_until)

MODEL = "tiny"
CONTEXT = 256
PAGE = 4
MESSAGES = [{"role": "user", "content": "hi"}]


class Script:
    """What the stand-in workers generate and what they saw."""

    def __init__(self, eos: int):
        self.eos = eos
        self.tokens: list[int] = []
        self.prefill_finish = duet_pb2.FINISH_REASON_UNSPECIFIED
        self.reserve_error: grpc.StatusCode | None = None
        self.prefill_delay_s = 0.0
        self.decode_delay_s = 0.0
        self.calls: list[tuple[str, object]] = []
        self.cancelled_rpcs: list[str] = []
        self.metadata: list[dict] = []
        self.reservations = itertools.count(1)

    def reset(self):
        self.prefill_finish = duet_pb2.FINISH_REASON_UNSPECIFIED
        self.reserve_error = None
        self.prefill_delay_s = self.decode_delay_s = 0.0
        self.calls.clear()
        self.cancelled_rpcs.clear()
        self.metadata.clear()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def note(self, name, request, context):
        self.calls.append((name, request))
        self.metadata.append(dict(context.invocation_metadata() or ()))


class StandInDecode(GenerateStreamsServicer, duet_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script):
        self.s = script

    async def Reserve(self, request, context):
        self.s.note("Reserve", request, context)
        if self.s.reserve_error is not None:
            await context.abort(self.s.reserve_error, "no free KV pages within 50 ms")
        return duet_pb2.Reservation(reservation_id=next(self.s.reservations), generation=1,
                                    decode_worker_id="decode-1", page_size=PAGE)

    async def Cancel(self, request, context):
        self.s.note("Cancel", request, context)
        return duet_pb2.CancelReply(cancelled=True)

    async def Generate(self, request, context):
        self.s.note("Generate", request, context)
        want = request.sampling.logprobs
        start = 1 if request.HasField("reservation") else 0  # split: prefill made token 0
        tokens = self.s.tokens + [self.s.eos]
        limit = request.sampling.max_tokens
        try:
            for n in range(start, min(len(tokens), limit)):
                if self.s.decode_delay_s:
                    await asyncio.sleep(self.s.decode_delay_s)
                token = duet_pb2.Token(id=tokens[n], logprob=-0.5 if want else 0.0)
                done = n == len(tokens) - 1 or n + 1 >= limit
                if not done:
                    yield duet_pb2.TokenChunk(tokens=[token])
                    continue
                reason = duet_pb2.FINISH_REASON_STOP if tokens[n] == self.s.eos else duet_pb2.FINISH_REASON_LENGTH
                yield duet_pb2.TokenChunk(tokens=[token], finish_reason=reason,
                                          usage=duet_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                               completion_tokens=n + 1, cached_tokens=0))
                return
        except asyncio.CancelledError:
            self.s.cancelled_rpcs.append("Generate")
            raise


class StandInPrefill(duet_pb2_grpc.PrefillServicer):
    def __init__(self, script: Script):
        self.s = script

    async def Prefill(self, request, context):
        self.s.note("Prefill", request, context)
        try:
            if self.s.prefill_delay_s:
                await asyncio.sleep(self.s.prefill_delay_s)
        except asyncio.CancelledError:
            self.s.cancelled_rpcs.append("Prefill")
            raise
        tokens = self.s.tokens + [self.s.eos]
        finish = self.s.prefill_finish
        if request.sampling.max_tokens == 1 and finish == duet_pb2.FINISH_REASON_UNSPECIFIED:
            finish = duet_pb2.FINISH_REASON_LENGTH
        return duet_pb2.PrefillReply(first_token=duet_pb2.Token(id=tokens[0], logprob=-0.5),
                                     cached_tokens=4, computed_tokens=len(request.prompt_token_ids) - 4,
                                     finish_reason=finish)


class Cluster(RouterCluster):
    """Redis + router + stand-in workers (registered in the registry) on one loop thread."""

    def __init__(self, eos: int):
        super().__init__(MODEL)
        self.script = Script(eos)

    async def _start_workers(self):
        self.workers = grpc.aio.server()
        duet_pb2_grpc.add_DecodeServicer_to_server(StandInDecode(self.script), self.workers)
        duet_pb2_grpc.add_PrefillServicer_to_server(StandInPrefill(self.script), self.workers)
        self.worker_port = self.workers.add_insecure_port("127.0.0.1:0")
        await self.workers.start()

    async def _stop_workers(self):
        await self.workers.stop(0)

    def add_worker(self, worker_id: str, role: str):
        self.publish(WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{self.worker_port}", model=MODEL,
                                page_size=PAGE, compat_hash="c1", load=WorkerLoad(free_pages=1000, total_pages=1000)))

    def remove_worker(self, worker_id: str):
        async def remove():
            await self.publishers.pop(worker_id).stop()
            assert await self.router.watcher.wait_for(lambda w: not w.is_live(worker_id), 5)

        self.loop.run(remove())

    def router_inflight(self) -> dict:
        return self.loop.run(_call(self.router.service.inflight.per_worker))


async def _call(fn):
    return fn()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT))


@pytest.fixture(scope="module")
def cluster(prompts):
    with Cluster(prompts.tokenizer.eos_token_id) as c:
        yield c


@pytest.fixture(scope="module")
def spans():
    return in_memory_spans()


@pytest.fixture(scope="module")
def gateway(cluster, prompts, spans):
    backend = GrpcBackend(GrpcBackendConfig(router_address=f"127.0.0.1:{cluster.router.port}", model=MODEL,
                                            max_context_len=CONTEXT, redis_url=cluster.redis.url,
                                            reserve_timeout_ms=50, rpc_timeout_s=30))
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT, tracer=spans[0].get_tracer("test"))
    with UvicornThread(build_app(ctx)) as server:
        yield server


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
def split_pair(cluster, gateway):
    """prefill-1 and decode-1 registered and seen by the router and the gateway (the first test
    registers them as its scenario; a test run alone gets them here)."""
    for worker_id, role in (("prefill-1", "prefill"), ("decode-1", "decode")):
        if worker_id not in cluster.publishers:
            cluster.add_worker(worker_id, role)
    assert cluster.loop.run(cluster.router.watcher.wait_for(
        lambda w: w.is_live("prefill-1") and w.is_live("decode-1"), 5))
    assert wait_until(lambda: httpx.get(gateway.base_url + "/health").status_code == 200, timeout=5)


@pytest.fixture
def reply(cluster, prompts):
    cluster.script.reset()

    def set_reply(text: str) -> list[int]:
        cluster.script.tokens = prompts.tokenizer.encode(text, add_special_tokens=False)
        return cluster.script.tokens

    return set_reply


def test_health_waits_for_a_decode_worker_then_split_path(gateway, cluster, client, reply, spans):
    assert httpx.get(gateway.base_url + "/health").status_code == 503  # router up, no workers yet
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 503
    cluster.add_worker("prefill-1", "prefill")
    cluster.add_worker("decode-1", "decode")
    assert wait_until(lambda: httpx.get(gateway.base_url + "/health").status_code == 200, timeout=5)

    reply("Hello from two pools")
    cluster.script.reset()
    cached_before = cached_prompt_tokens(gateway)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50)
    assert result.choices[0].message.content == "Hello from two pools"
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.prompt_tokens_details.cached_tokens == 4
    assert cached_prompt_tokens(gateway) - cached_before == 4  # what the answer's usage said
    s = cluster.script
    assert s.names() == ["Reserve", "Prefill", "Generate"]
    reserve, prefill, generate = (request for _, request in s.calls)
    assert reserve.prompt_tokens == result.usage.prompt_tokens and reserve.max_tokens == 50
    assert reserve.prefill_worker_id == "prefill-1"
    assert prefill.reservation.reservation_id == generate.reservation.reservation_id
    assert generate.first_token.id == s.tokens[0] and generate.prefill_worker_id == "prefill-1"
    assert list(generate.prompt_token_ids) == list(prefill.prompt_token_ids)
    assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5), "router load not released"
    # One trace: every RPC carried the gateway span's W3C context.
    trace_ids = {m.get("traceparent", "").split("-")[1] for m in s.metadata if "traceparent" in m}
    gateway_spans = [sp for sp in spans[1].get_finished_spans() if sp.name == "POST /v1/chat/completions"]
    assert len(trace_ids) == 1 and f"{gateway_spans[-1].context.trace_id:032x}" in trace_ids


def cached_prompt_tokens(gateway) -> float:
    page = Metrics.parse(httpx.get(gateway.base_url + "/metrics").text)
    return page.value("duet_cached_prompt_tokens_total", endpoint="chat_completions")


def test_split_stream_schema_and_logprobs(gateway, cluster, reply, spans, split_pair):
    reply("你好 😀 ok")
    cached_before = cached_prompt_tokens(gateway)
    with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "stream": True, "logprobs": True,
                "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            request_id = response.headers["x-request-id"]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    for e in events:
        validate(e, "CreateChatCompletionStreamResponse")
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == "你好 😀 ok"
    logprobs = [lp for e in events for c in e["choices"] if c["logprobs"] for lp in c["logprobs"]["content"]]
    assert len(logprobs) == events[-1]["usage"]["completion_tokens"]
    # the stream's usage counted, and its span: first event to [DONE], under the request's root
    usage = events[-1]["usage"]
    assert cached_prompt_tokens(gateway) - cached_before == usage["prompt_tokens_details"]["cached_tokens"] == 4
    def request_spans():  # the root ends as the stream closes, maybe after the client read [DONE]
        return [sp for sp in spans[1].get_finished_spans() if sp.attributes.get("duet.request_id") == request_id]
    assert wait_until(lambda: any(sp.parent is None for sp in request_spans()), timeout=5)
    finished = request_spans()
    [root] = [sp for sp in finished if sp.parent is None]
    [stream] = [sp for sp in finished if sp.name == "stream"]
    assert stream.parent.span_id == root.context.span_id
    assert root.start_time < stream.start_time < stream.end_time <= root.end_time
    assert stream.attributes["duet.stream.events"] == len(lines)
    assert stream.attributes["duet.completion_tokens"] == events[-1]["usage"]["completion_tokens"]
    assert stream.attributes["duet.cached_tokens"] == 4 and stream.attributes["duet.stream.disconnected"] is False


def test_first_token_ends_request_cancels_reservation(client, cluster, reply, split_pair):
    reply("Hello there")
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 1
    s = cluster.script
    assert wait_until(lambda: s.names() == ["Reserve", "Prefill", "Cancel"], timeout=5), s.names()
    assert s.calls[2][1].reservation_id == s.calls[1][1].reservation.reservation_id  # the prefill's
    assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5)


def test_stop_string_in_first_token_cancels_reservation(client, cluster, reply, prompts, split_pair):
    tokens = reply("Hello there")
    first_text = prompts.tokenizer.decode(tokens[:1])
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=20, stop=[first_text])
    assert result.choices[0].text == "" and result.choices[0].finish_reason == "stop"
    assert wait_until(lambda: cluster.script.names() == ["Reserve", "Prefill", "Cancel"], timeout=5), \
        cluster.script.names()


def test_decode_admission_refused_is_429(client, cluster, reply, split_pair):
    reply("nope")
    cluster.script.reserve_error = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(openai.RateLimitError, match="no free KV pages"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    assert cluster.script.names() == ["Reserve"]
    assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5)


def test_disconnect_during_decode_cancels_stream_and_reservation(gateway, cluster, reply, split_pair):
    reply("word " * 100)
    cluster.script.decode_delay_s = 0.03
    with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "messages": MESSAGES, "stream": True}) as response:
            seen = 0
            for line in response.iter_lines():
                seen += '"content":' in line
                if seen == 4:
                    break
    s = cluster.script
    assert wait_until(lambda: "Generate" in s.cancelled_rpcs, timeout=5), "decode stream not cancelled"
    assert wait_until(lambda: "Cancel" in s.names(), timeout=5)
    assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5)


def test_disconnect_during_prefill_cancels_prefill_and_reservation(gateway, cluster, reply, split_pair):
    reply("slow prefill")
    cluster.script.prefill_delay_s = 5
    with httpx.Client(base_url=gateway.base_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    s = cluster.script
    assert wait_until(lambda: "Prefill" in s.cancelled_rpcs, timeout=3), "prefill RPC not cancelled"
    assert wait_until(lambda: s.names() == ["Reserve", "Prefill", "Cancel"], timeout=3), s.names()
    assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5)


def test_colocated_worker_gets_one_generate(client, cluster, reply):
    cluster.remove_worker("prefill-1")
    cluster.remove_worker("decode-1")
    cluster.add_worker("both-1", "both")
    try:
        reply("all in one")
        result = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=-5, temperature=0.5)
        assert result.choices[0].message.content == "all in one"
        assert cluster.script.names() == ["Generate"]
        generate = cluster.script.calls[0][1]
        assert not generate.HasField("reservation")
        assert generate.sampling.seed == (-5) % (1 << 64) and abs(generate.sampling.temperature - 0.5) < 1e-6
    finally:
        cluster.remove_worker("both-1")


class _SilentRouter(duet_pb2_grpc.RouterServicer):
    """A router process that accepts the call and never answers (as one did whose start had
    failed half way, alive and listening)."""

    async def Route(self, request, context):
        await asyncio.sleep(3600)


def test_a_router_that_never_answers_is_a_503_within_the_route_timeout(prompts):
    loop = LoopThread()

    async def serve():  # made on the loop that runs it
        server = grpc.aio.server()
        duet_pb2_grpc.add_RouterServicer_to_server(_SilentRouter(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(serve())
    backend = GrpcBackend(GrpcBackendConfig(router_address=f"127.0.0.1:{port}", model=MODEL, max_context_len=CONTEXT,
                                            route_timeout_s=1.0))
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT)
    try:
        with UvicornThread(build_app(ctx)) as gw, \
                openai.OpenAI(base_url=gw.base_url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model=MODEL, messages=MESSAGES)
            took = time.monotonic() - t0
        assert info.value.status_code == 503 and "router" in str(info.value.body), info.value.body
        assert took < 10, took
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_a_request_while_the_router_restarts_waits_for_it(client, cluster, reply):
    """The router killed and started again on its port (duet up's supervisor): a request that
    arrives meanwhile waits for it (within --route-timeout) and is served, not a 503."""
    from services.router.server import RouterServer

    cluster.add_worker("both-r", "both")
    try:
        reply("after the restart")
        old = cluster.router
        cluster.loop.run(old.stop())
        result, errors = {}, []

        def ask():
            try:
                result["r"] = client.chat.completions.create(model=MODEL, messages=MESSAGES)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive() and not errors, errors  # waiting for the router, not refused
        config = dataclasses.replace(old.config, port=old.port)
        cluster.router = RouterServer(config)
        cluster.loop.run(cluster.router.start())
        thread.join(30)
        assert not errors, errors
        assert result["r"].choices[0].message.content == "after the restart"
        assert wait_until(lambda: cluster.router_inflight() == {}, timeout=5)  # released to the new router
    finally:
        cluster.remove_worker("both-r")


def test_each_route_carries_the_prompt_tokens_waiting_in_the_gateways_admission(prompts):
    """What the router's overflow rule weighs as the prefill workers' backlog (placement.py):
    the gateway's own admission queue of the route's model, read when the route is sent."""
    from services.gateway.http_edge.admission import Work
    from services.gateway.http_edge.limits_config import GatewayLimits

    backend = GrpcBackend(GrpcBackendConfig(router_address="127.0.0.1:9", model=MODEL))  # never dialled
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT,
                         limits=GatewayLimits(max_prefill_tokens=100))

    async def scenario():
        assert backend.admission_backlog(MODEL) == 0
        running = await ctx.admission.ticket("k").acquire(Work(prompt_tokens=100, pool=MODEL))  # the budget, full
        waiting = asyncio.ensure_future(ctx.admission.ticket("k").acquire(Work(prompt_tokens=700, pool=MODEL)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and backend.admission_backlog(MODEL) == 700
        assert backend.admission_backlog("another-model") == 0  # a pool of its own
        running.release()
        (await waiting).release()
        assert backend.admission_backlog(MODEL) == 0

    asyncio.run(scenario())
