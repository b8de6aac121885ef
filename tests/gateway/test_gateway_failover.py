"""Failover the client never sees, at the gateway (services/gateway/backends/migration.py):
the official `openai` client against a real uvicorn gateway, the real Router over a real
Redis registry, and real gRPC to scripted Prefill/Decode servers that speak duet.proto (the
engine's side of a resumed stream: tests/engine/test_engine_resume.py; the whole stack with a
decode worker killed: tests/e2e/test_e2e_failover.py).

The scripted workers are a deterministic "model": sequence i of a request seeded s says
TEXTS[s + i] (unseeded: TEXTS[None]) from whatever output position it is asked to go on from
(`resumed_output_tokens`), so a continuation that starts at the wrong place, repeats or drops
a token, or draws with the wrong seed shows in the text. A decode server can be told to drop
its stream (UNAVAILABLE) after some chunks, a prefill server to fail with or without blaming
the decode worker its writes went to."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import openai
import pytest

from protos import duet_pb2, duet_pb2_grpc
from services.decode.stream_mux import GenerateStreamsServicer
from services.gateway.backends.grpc_workers import GrpcBackend, GrpcBackendConfig
from services.gateway.backends.migration import MigrationConfig
from services.gateway.backends.migration_metrics import MigrationMetrics
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from shared.registry.worker_info import WorkerInfo, WorkerLoad
from shared.wire.fault import FAULT_KEY
from tests.helpers.gateway_support import RouterCluster, UvicornThread, byte_level_tokenizer_dir, in_memory_spans
from tests.helpers.stack import wait_until

MODEL = "tiny"
CONTEXT = 256
PAGE = 4
CHECKPOINT = "ck-1"
MESSAGES = [{"role": "user", "content": "hi"}]
TEXTS = {None: "Hello world, the quick brown fox jumps over the lazy dog.",
         7: "The answer is 42. STOP here. The end.",
         8: "Emoji time café naïve résumé, hello there!"}


class Script:
    """What the scripted workers say, how they fail, and every call they got."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.generate_drops: list[int | None] = []  # per Generate call: drop the stream after this many chunks
        self.prefill_faults: list[str | None] = []  # per Prefill call: "decode", "prefill" or None
        self.calls: list[tuple[str, str, object]] = []  # (server, method, request)
        self.reservations = itertools.count(1)

    def reset(self):
        self.generate_drops.clear()
        self.prefill_faults.clear()
        self.calls.clear()

    def tokens(self, seed: int | None, index: int) -> list[int]:
        key = None if seed is None else seed + index
        return self.tokenizer.encode(TEXTS[key], add_special_tokens=False) + [self.eos]

    def of(self, method: str) -> list[tuple[str, object]]:
        return [(server, request) for server, m, request in self.calls if m == method]


def _seed(sampling) -> int | None:
    return sampling.seed if sampling.HasField("seed") else None


def _token(script: Script, tokens: list[int], position: int, sampling) -> duet_pb2.Token:
    return duet_pb2.Token(id=tokens[position], logprob=-0.25 - position if sampling.logprobs else 0.0)


def _finish(tokens: list[int], position: int, limit: int, eos: int) -> int:
    if tokens[position] == eos:
        return duet_pb2.FINISH_REASON_STOP
    if position + 1 >= limit:
        return duet_pb2.FINISH_REASON_LENGTH
    return duet_pb2.FINISH_REASON_UNSPECIFIED


class ScriptedDecode(GenerateStreamsServicer, duet_pb2_grpc.DecodeServicer):
    def __init__(self, name: str, script: Script):
        self.name, self.s = name, script

    async def Reserve(self, request, context):
        self.s.calls.append((self.name, "Reserve", request))
        return duet_pb2.Reservation(reservation_id=next(self.s.reservations), generation=1,
                                    decode_worker_id=self.name, page_size=PAGE)

    async def Cancel(self, request, context):
        self.s.calls.append((self.name, "Cancel", request))
        return duet_pb2.CancelReply(cancelled=True)

    async def Generate(self, request, context):
        self.s.calls.append((self.name, "Generate", request))
        drop = self.s.generate_drops.pop(0) if self.s.generate_drops else None
        sampling, n = request.sampling, max(request.sampling.n, 1)
        given = request.resumed_output_tokens
        start = given + (1 if request.HasField("reservation") else 0)  # split: prefill made one
        seqs = [self.s.tokens(_seed(sampling), i) for i in range(n)]
        positions = {i: start for i in range(n)
                     if not (start > 0 and _finish(seqs[i], start - 1, sampling.max_tokens, self.s.eos))}
        sent = 0
        while positions:
            for i in sorted(positions):
                if drop is not None and sent >= drop:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} went away")
                await asyncio.sleep(0.002)
                p = positions[i]
                finish = _finish(seqs[i], p, sampling.max_tokens, self.s.eos)
                chunk = duet_pb2.TokenChunk(tokens=[_token(self.s, seqs[i], p, sampling)], index=i,
                                            finish_reason=finish)
                positions[i] = p + 1
                if finish:
                    del positions[i]
                    if not positions:
                        chunk.usage.CopyFrom(duet_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                            completion_tokens=p + 1, cached_tokens=0))
                sent += 1
                yield chunk


class ScriptedPrefill(duet_pb2_grpc.PrefillServicer):
    def __init__(self, name: str, script: Script):
        self.name, self.s = name, script

    async def Prefill(self, request, context):
        self.s.calls.append((self.name, "Prefill", request))
        fault = self.s.prefill_faults.pop(0) if self.s.prefill_faults else None
        if fault == "decode":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV transfer to the decode worker failed",
                                trailing_metadata=((FAULT_KEY, "decode"),))
        if fault == "prefill":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is going away")
        sampling, given = request.sampling, request.resumed_output_tokens
        starts = []
        for i in range(max(sampling.n, 1)):
            tokens = self.s.tokens(_seed(sampling), i)
            starts.append(duet_pb2.SequenceStart(first_token=_token(self.s, tokens, given, sampling),
                                                 finish_reason=_finish(tokens, given, sampling.max_tokens,
                                                                       self.s.eos)))
        prompt = len(request.prompt_token_ids) - given  # it holds the prompt; the streamed tokens are new
        return duet_pb2.PrefillReply(first_token=starts[0].first_token, finish_reason=starts[0].finish_reason,
                                     sequences=starts, cached_tokens=prompt, computed_tokens=given)


class Cluster(RouterCluster):
    """Redis, the router, two scripted decode servers and two scripted prefill workers."""

    def __init__(self, tokenizer):
        super().__init__(MODEL)
        self.script = Script(tokenizer)
        self.infos: dict[str, WorkerInfo] = {}
        self.servers = []

    async def _start_workers(self):
        for name, role in (("decode-a", "decode"), ("decode-b", "decode"), ("prefill-1", "prefill"),
                           ("prefill-2", "prefill")):
            server = grpc.aio.server()
            if role == "decode":
                duet_pb2_grpc.add_DecodeServicer_to_server(ScriptedDecode(name, self.script), server)
            else:
                duet_pb2_grpc.add_PrefillServicer_to_server(ScriptedPrefill(name, self.script), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            self.infos[name] = WorkerInfo(worker_id=name, role=role, address=f"127.0.0.1:{port}", model=MODEL,
                                          page_size=PAGE, compat_hash="c1", checkpoint=CHECKPOINT,
                                          load=WorkerLoad(free_pages=1000, total_pages=1000))

    async def _stop_workers(self):
        for server in self.servers:
            await server.stop(0)

    def __enter__(self):
        super().__enter__()
        for info in self.infos.values():
            self.publish(info)
        return self


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT))


@pytest.fixture(scope="module")
def cluster(prompts):
    with Cluster(prompts.tokenizer) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster, prompts):
    """The gateway (failover: 3 moves, 3 s each), its metrics, and the spans it ends."""
    metrics, (provider, spans) = GatewayMetrics(), in_memory_spans()
    tracer = provider.get_tracer("duet-gateway")
    backend = GrpcBackend(GrpcBackendConfig(router_address=f"127.0.0.1:{cluster.router.port}", model=MODEL,
                                            max_context_len=CONTEXT, redis_url=cluster.redis.url, rpc_timeout_s=30,
                                            migration=MigrationConfig(limit=3, deadline_s=3.0)),
                          MigrationMetrics(metrics.registry), tracer=tracer)
    with UvicornThread(build_app(GatewayContext(backend, prompts, metrics, MODEL, CONTEXT, tracer=tracer))) as server:
        server.backend, server.metrics, server.spans = backend, metrics, spans
        yield server


@pytest.fixture
def client(gateway, cluster):
    cluster.script.reset()
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def counter(gateway, name: str, **labels) -> float:
    return gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def stream_chat(client, **kw) -> tuple[dict[int, str], dict[int, str], object, list]:
    """Stream a chat completion: text and finish reason by choice index, the usage, and the
    logprob entries in order."""
    texts, reasons, usage, logprobs = {}, {}, None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
            if choice.logprobs and choice.logprobs.content:
                logprobs += choice.logprobs.content
    return texts, reasons, usage, logprobs


def test_a_stream_whose_decode_worker_dies_goes_on_elsewhere_with_every_token_once(gateway, cluster, client):
    script = cluster.script
    tokens = script.tokens(None, 0)
    script.generate_drops = [5]  # the first decode stream breaks after 5 chunks: 6 tokens streamed
    before = counter(gateway, "duet_migrations_total", cause="decode_stream")
    texts, reasons, usage, logprobs = stream_chat(client, max_tokens=100, logprobs=True)
    assert texts == {0: TEXTS[None]} and reasons == {0: "stop"}
    assert usage.completion_tokens == len(tokens)  # every token counted once (EOS included)
    assert [round(lp.logprob, 2) for lp in logprobs] == [-0.25 - p for p in range(len(tokens))]

    (first_decode, _), (second_decode, resumed) = script.of("Generate")
    assert {first_decode, second_decode} == {"decode-a", "decode-b"}  # never back to the one that failed
    (_, first_prefill), (_, prefill) = script.of("Prefill")
    prompt = list(first_prefill.prompt_token_ids)
    assert list(prefill.prompt_token_ids) == prompt + tokens[:6] and prefill.resumed_output_tokens == 6
    assert list(resumed.prompt_token_ids) == prompt + tokens[:6] and resumed.resumed_output_tokens == 6
    assert resumed.first_token.id == tokens[6]
    (_, first_reserve), (_, reserve) = script.of("Reserve")
    assert reserve.max_tokens == 100 - 6 and reserve.prompt_tokens == len(prompt) + 6
    assert prefill.request_id == first_prefill.request_id + "~m1"

    assert counter(gateway, "duet_migrations_total", cause="decode_stream") == before + 1
    assert counter(gateway, "duet_migration_rebuilt_tokens_total", source="moved") >= len(prompt)
    assert counter(gateway, "duet_migration_rebuilt_tokens_total", source="recomputed") >= 6
    # one trace: the migrate span and the moved attempt's RPCs are in the request's
    # the server's span ends once the response is done: the client may have read the last chunk first
    wait_until(lambda: any(s.name == "POST /v1/chat/completions" for s in gateway.spans.get_finished_spans()),
               5, "the request's root span to end")
    finished = gateway.spans.get_finished_spans()
    root = [s for s in finished if s.name == "POST /v1/chat/completions"][-1]
    migrate = [s for s in finished if s.name == "migrate"][-1]
    assert migrate.context.trace_id == root.context.trace_id and migrate.parent.span_id == root.context.span_id
    assert migrate.attributes["duet.migration.cause"] == "decode_stream"
    assert migrate.attributes["duet.migration.lost_worker"] == first_decode
    assert migrate.attributes["duet.migration.streamed_tokens"] == 6
    assert migrate.attributes["duet.migration.rebuilt_moved_tokens"] == len(prompt)
    assert migrate.attributes["duet.migration.outcome"] == "resumed"
    assert [e.name for e in migrate.events] == ["worker_lost"]


def test_a_stop_string_across_the_seam_ends_where_the_unfaulted_stream_ends(gateway, cluster, client):
    tokens = cluster.script.tokens(7, 0)
    decode = cluster.script.tokenizer.decode
    seam = next(k for k in range(2, len(tokens)) if decode(tokens[:k]).endswith("ST"))  # "...ST" | "OP..."
    stop = decode(tokens[:seam])[-2:] + decode(tokens[:seam + 1])[len(decode(tokens[:seam])):][:2]
    unfaulted = stream_chat(client, max_tokens=100, seed=7, temperature=1.0, stop=[stop])
    cluster.script.reset()
    cluster.script.generate_drops = [seam - 1]  # prefill's token, then seam - 1 from decode
    faulted = stream_chat(client, max_tokens=100, seed=7, temperature=1.0, stop=[stop])
    moved = cluster.script.of("Prefill")[1][1]  # its first token completes the stop string
    assert moved.resumed_output_tokens == seam
    assert faulted[0] == unfaulted[0] == {0: TEXTS[7][:TEXTS[7].index(stop)]}
    assert faulted[1] == unfaulted[1] == {0: "stop"}
    assert faulted[2].completion_tokens == unfaulted[2].completion_tokens


def test_each_sequence_of_n_2_goes_on_with_its_own_seed_and_tokens(gateway, cluster, client):
    cluster.script.generate_drops = [9]  # chunks alternate between the two sequences
    texts, reasons, usage, _ = stream_chat(client, max_tokens=100, seed=7, temperature=1.0, n=2)
    assert texts == {0: TEXTS[7], 1: TEXTS[8]} and reasons == {0: "stop", 1: "stop"}
    assert usage.completion_tokens == len(cluster.script.tokens(7, 0)) + len(cluster.script.tokens(7, 1))
    moved = [r for _, r in cluster.script.of("Prefill")][1:]
    assert sorted((r.sampling.seed, r.sampling.n) for r in moved) == [(7, 1), (8, 1)]
    for r in moved:
        index = r.sampling.seed - 7
        streamed = cluster.script.tokens(7, index)[:r.resumed_output_tokens]
        assert list(r.prompt_token_ids)[-r.resumed_output_tokens:] == streamed
        assert r.request_id.endswith(f"~m1.{index}")
    assert sum(r.resumed_output_tokens for r in moved) == 1 + 1 + 9  # the two firsts and 9 chunks


def test_a_prefill_whose_writes_into_decode_failed_moves_away_from_that_decode(gateway, cluster, client):
    script = cluster.script
    script.prefill_faults = ["decode"]
    before = counter(gateway, "duet_migrations_total", cause="kv_handoff")
    texts, reasons, _, _ = stream_chat(client, max_tokens=100)
    assert texts == {0: TEXTS[None]} and reasons == {0: "stop"}
    (first, _), (second, _) = script.of("Reserve")
    assert first != second  # the decode worker is the one left
    (_, first_prefill), (_, second_prefill) = script.of("Prefill")
    assert second_prefill.resumed_output_tokens == 0  # nothing had reached the client: a plain retry
    cancels = [r for _, r in script.of("Cancel")]
    assert cancels and not cancels[0].prefill_not_sent  # the first reservation given back
    assert counter(gateway, "duet_migrations_total", cause="kv_handoff") == before + 1


def test_a_prefill_worker_that_fails_is_left_for_another(gateway, cluster, client):
    script = cluster.script
    script.prefill_faults = ["prefill"]
    texts, _, _, _ = stream_chat(client, max_tokens=100)
    assert texts == {0: TEXTS[None]}
    (first, _), (second, _) = script.of("Prefill")
    assert first != second


def test_past_the_limit_the_client_gets_the_error(gateway, cluster, client):
    migration = gateway.backend.config.migration
    migration.limit = 1
    try:
        cluster.script.generate_drops = [3, 3]  # the stream and its one move both break
        before = counter(gateway, "duet_migrations_given_up_total", reason="limit")
        with pytest.raises(openai.APIError):
            stream_chat(client, max_tokens=100)
        assert counter(gateway, "duet_migrations_given_up_total", reason="limit") == before + 1
    finally:
        migration.limit = 3


def test_with_no_worker_left_the_client_gets_the_error_past_the_deadline(gateway, cluster, client):
    cluster.script.generate_drops = [3, 3, 3]  # both decode workers fail: nothing left to move to
    before = counter(gateway, "duet_migrations_given_up_total", reason="deadline")
    with pytest.raises(openai.APIError):
        stream_chat(client, max_tokens=100)
    assert counter(gateway, "duet_migrations_given_up_total", reason="deadline") == before + 1
    assert len(cluster.script.of("Generate")) == 2
