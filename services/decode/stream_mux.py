"""Many Generate streams over one gRPC call (Decode.GenerateStreams), batched per step.

A Generate call per request costs its process ~30 us of grpc's asyncio machinery for every
message, one message per stream per engine step: at 256 streams that is ~8 ms of the GIL per
step on the thread the engine thread shares it with (docs/performance/serving.md). Here every
stream runs the same Generate handler, but its chunks go into one outbox that is sent as one
message once the step's outputs have reached every stream (the handlers wake in the order the
step delivered to them; the writer wakes after them), so a step costs one message per gateway.

A stream's error (what Generate's `context.abort` would end its call with) becomes the status
of its last piece; the caller's cancel of one stream ends only that stream; the call's end (the
gateway left or its connection died) ends every stream it carried, as each call's end did."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc

from protos import duet_pb2
from shared.wire.stream_end import end_piece

log = logging.getLogger("duet.decode.streams")

# A reply over this is split: the gateway's channel takes 4 MiB messages (prompt logprobs of
# long prompts make big chunks; a step's token chunks are a few KiB).
MAX_REPLY_BYTES = 1 << 20


class StreamAborted(Exception):
    """What `StreamContext.abort` raises: the stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class StreamContext:
    """The part of a grpc ServicerContext the Generate handler uses, for one stream of a call."""

    def __init__(self, trace_context: dict[str, str]):
        self._metadata = tuple((k.lower(), v) for k, v in trace_context.items())

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise StreamAborted(code, details)


class _Outbox:
    """Pieces waiting for the next reply, and the writer's wake-up."""

    def __init__(self):
        self.pieces: list[duet_pb2.StreamPiece] = []
        self.wake = asyncio.Event()

    def put(self, piece: duet_pb2.StreamPiece) -> None:
        self.pieces.append(piece)
        self.wake.set()

    def replies(self) -> list[duet_pb2.StreamsReply]:
        """Everything waiting, as few replies as the size limit allows."""
        out, batch, size = [], [], 0
        for piece in self.pieces:
            chunk = piece.chunk  # plain tokens are a few bytes each; logprob lists are measured
            n = piece.ByteSize() if chunk.prompt_logprobs or (chunk.tokens and chunk.tokens[0].top_logprobs) \
                else 16 * (len(chunk.tokens) + 1)
            if batch and size + n > MAX_REPLY_BYTES:
                out.append(duet_pb2.StreamsReply(pieces=batch))
                batch, size = [], 0
            batch.append(piece)
            size += n
        if batch:
            out.append(duet_pb2.StreamsReply(pieces=batch))
        self.pieces = []
        return out


async def serve_streams(generate: Callable[[duet_pb2.GenerateRequest, StreamContext], AsyncIterator],
                        requests: AsyncIterator[duet_pb2.StreamsRequest]) -> AsyncIterator[duet_pb2.StreamsReply]:
    """The GenerateStreams handler's body: run `generate` (the Generate handler) for every
    stream the caller opens, yield their chunks batched."""
    outbox = _Outbox()
    running: dict[int, asyncio.Task] = {}

    async def pump(stream_id: int, request: duet_pb2.GenerateRequest, trace_context) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async with aclosing(generate(request, StreamContext(trace_context))) as chunks:
                async for chunk in chunks:
                    outbox.put(duet_pb2.StreamPiece(stream_id=stream_id, chunk=chunk))
        except StreamAborted as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:  # cancelled by its caller, or the call ended: nothing to say
            running.pop(stream_id, None)
            raise
        except Exception as exc:  # what grpc would have made an UNKNOWN status of
            log.exception("stream %d of a GenerateStreams call failed", stream_id)
            code, details = grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"
        running.pop(stream_id, None)
        outbox.put(end_piece(stream_id, code, details))

    async def read() -> None:
        try:
            await take(requests)
        finally:  # the caller sends no more, or its side failed: the writer looks at why
            outbox.wake.set()

    async def take(requests) -> None:
        async for msg in requests:
            if msg.HasField("generate"):
                if msg.stream_id in running:
                    outbox.put(end_piece(msg.stream_id, grpc.StatusCode.INVALID_ARGUMENT,
                                         f"stream {msg.stream_id} is already open in this call"))
                    continue
                running[msg.stream_id] = asyncio.ensure_future(
                    pump(msg.stream_id, msg.generate, dict(msg.trace_context)))
            elif msg.cancel:
                task = running.get(msg.stream_id)
                if task is not None:  # else it ended already: its end piece is on its way
                    task.cancel()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            for reply in outbox.replies():
                yield reply
            if reader.done():
                reader.result()  # the caller's side failed: end the call (finally ends its streams)
                if not running and not outbox.pieces:
                    return
    finally:
        reader.cancel()
        tasks = list(running.values())
        for task in tasks:
            task.cancel()  # each Generate's `finally` aborts its request and frees its pages
        await asyncio.gather(reader, *tasks, return_exceptions=True)


class GenerateStreamsServicer:
    """Decode.GenerateStreams for a servicer that has Generate: mix it in before the generated
    DecodeServicer (whose GenerateStreams answers UNIMPLEMENTED)."""

    async def GenerateStreams(self, request_iterator, context):
        async for reply in serve_streams(self.Generate, request_iterator):
            yield reply
