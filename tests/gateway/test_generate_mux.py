"""Many Generate streams over one Decode.GenerateStreams call: the gateway's GenerateMux
(services/gateway/backends/generate_mux.py) against the worker's serve_streams
(services/decode/stream_mux.py), both the shipped code, over a real gRPC server. The worker's
Generate here is scripted (a token per step, every stream stepping together, as the engine's
outputs reach the handlers); the engine-backed worker's streams are checked in
tests/disagg/test_generate_streams.py.

What the gateway relies on: every stream gets exactly its own chunks in order, a step's
chunks of all streams come in about one message, a stream's error or cancel touches no other
stream, the call's end ends every open stream with a status the gateway treats as a lost
worker, and the next stream opens a new call."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from services.decode.stream_mux import GenerateStreamsServicer
from services.gateway.backends.generate_mux import GenerateMux
from tests.helpers.gateway_support import free_port

STEP_WAIT_S = 0.005


class SteppedDecode(GenerateStreamsServicer, duet_pb2_grpc.DecodeServicer):
    """Generate: request.sampling.max_tokens tokens (id = stream's seed + step), one per step;
    prompt token 0 == 666: INVALID_ARGUMENT at once; == 667: a handler bug (ValueError)."""

    def __init__(self):
        self.step = 0
        self.stepped = asyncio.Condition()
        self.cancelled: list[str] = []
        self.metadata: dict[str, dict] = {}

    async def advance(self, steps: int) -> None:
        for _ in range(steps):
            async with self.stepped:
                self.step += 1
                self.stepped.notify_all()
            await asyncio.sleep(STEP_WAIT_S)

    async def Generate(self, request, context):
        self.metadata[request.request_id] = dict(context.invocation_metadata())
        if request.prompt_token_ids[0] == 666:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt token 666 is refused")
        if request.prompt_token_ids[0] == 667:
            raise ValueError("a bug in the handler")
        seed, n = request.prompt_token_ids[0], request.sampling.max_tokens
        start = self.step
        try:
            for i in range(n):
                async with self.stepped:
                    await self.stepped.wait_for(lambda: self.step > start + i)
                last = i == n - 1
                yield duet_pb2.TokenChunk(tokens=[duet_pb2.Token(id=seed + i)],
                                          finish_reason=duet_pb2.FINISH_REASON_LENGTH if last else 0)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


def generate(rid: str, seed: int, tokens: int) -> duet_pb2.GenerateRequest:
    return duet_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[seed],
                                    sampling=duet_pb2.SamplingParams(max_tokens=tokens))


async def serve(servicer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    duet_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def collect(stream) -> list[int]:
    return [t.id for chunk in [c async for c in stream] for t in chunk.tokens]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@asynccontextmanager
async def stepped_worker():
    """(the scripted worker, a GenerateMux to it over a real server and channel)."""
    port = free_port()
    decode = SteppedDecode()
    server = await serve(decode, port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            mux = GenerateMux(channel)
            try:
                yield decode, mux
            finally:
                await mux.close()
    finally:
        await server.stop(0)


def test_streams_get_their_own_tokens_in_order_one_message_per_step():
    streams_n, steps = 32, 12

    async def main():
        async with stepped_worker() as (decode, mux):
            streams = [mux.open(generate(f"r{i}", 1000 * i, steps), [("traceparent", f"00-{i:032x}-{1:016x}-01")])
                       for i in range(streams_n)]
            readers = asyncio.gather(*(collect(s) for s in streams))
            while len(decode.metadata) < streams_n:  # every stream has reached its handler
                await asyncio.sleep(0.01)
            await decode.advance(steps)
            got = await readers
        return mux, decode, got

    mux, decode, got = run(main())
    assert got == [[1000 * i + k for k in range(steps)] for i in range(streams_n)]
    # each handler saw its own trace context, as a Generate call's metadata
    assert all(decode.metadata[f"r{i}"]["traceparent"] == f"00-{i:032x}-{1:016x}-01" for i in range(streams_n))
    assert mux.calls == 1 and mux.open_streams == 0
    assert mux.pieces == streams_n * (steps + 1)  # a chunk per step, then each stream's end
    # one message a step (a few more where a step's handlers straddled the writer's wake-up),
    # where a call per stream took streams_n messages a step
    assert mux.replies <= 2 * (steps + 1), (mux.replies, mux.pieces)


def test_a_refused_failed_or_cancelled_stream_ends_alone():
    async def main():
        async with stepped_worker() as (decode, mux):
            refused = mux.open(generate("refused", 666, 4))
            broken = mux.open(generate("broken", 667, 4))
            left = mux.open(generate("left", 10, 50))
            kept = mux.open(generate("kept", 20, 6))
            outcomes = {}
            for name, stream in (("refused", refused), ("broken", broken)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stream)
                outcomes[name] = (err.value.code(), err.value.details())
            kept_tokens = asyncio.ensure_future(collect(kept))
            while "left" not in decode.metadata or "kept" not in decode.metadata:
                await asyncio.sleep(0.01)
            await decode.advance(1)
            first = await left.__anext__()
            assert left.cancel() and not left.cancel()  # once
            await decode.advance(6)
            tokens = await kept_tokens
            while "left" not in decode.cancelled:
                await asyncio.sleep(0.01)
            calls = mux.calls
        return outcomes, [t.id for t in first.tokens], tokens, decode.cancelled, calls, mux.open_streams

    outcomes, first, tokens, cancelled, calls, still_open = run(main())
    assert outcomes["refused"] == (grpc.StatusCode.INVALID_ARGUMENT, "prompt token 666 is refused")
    assert outcomes["broken"][0] == grpc.StatusCode.UNKNOWN and "a bug in the handler" in outcomes["broken"][1]
    assert first == [10]
    assert tokens == [20 + k for k in range(6)]
    assert cancelled == ["left"]  # the worker's handler saw the cancel; no other stream was touched
    assert calls == 1 and still_open == 0


def test_the_calls_end_ends_every_open_stream_and_the_next_stream_opens_a_new_call():
    lost_codes = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}

    async def main():
        port = free_port()
        decode = SteppedDecode()
        server = await serve(decode, port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            mux = GenerateMux(channel)
            streams = [mux.open(generate(f"r{i}", 100 * i, 50)) for i in range(3)]
            while len(decode.metadata) < 3:
                await asyncio.sleep(0.01)
            await decode.advance(1)
            firsts = [await s.__anext__() for s in streams]
            await server.stop(0)  # the worker goes away with the streams open
            codes = []
            for stream in streams:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stream)
                codes.append(err.value.code())
            assert mux.open_streams == 0
            # the worker is back (a new server on the same port): the next stream opens a new call
            decode2 = SteppedDecode()
            server2 = await serve(decode2, port)
            again = mux.open(generate("again", 7, 3))
            reader = asyncio.ensure_future(collect(again))
            while "again" not in decode2.metadata:
                await asyncio.sleep(0.01)
            await decode2.advance(3)
            tokens = await reader
            calls = mux.calls
            await mux.close()
        await server2.stop(0)
        return [f.tokens[0].id for f in firsts], codes, tokens, calls

    firsts, codes, tokens, calls = run(main())
    assert firsts == [0, 100, 200]
    assert all(code in lost_codes for code in codes), codes  # each moves on as from a lost worker
    assert tokens == [7, 8, 9] and calls == 2
