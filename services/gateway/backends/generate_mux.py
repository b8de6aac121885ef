"""The gateway's Generate streams to one decode worker, over one Decode.GenerateStreams call.

`GenerateMux.open` gives what `DecodeStub.Generate` gave: an async iterator of TokenChunk that
raises `grpc.aio.AioRpcError` with the stream's status, and `cancel()`. All of a worker's
streams share one call (opened on first use, opened again after it ends), and the worker
sends their chunks batched, about one message per engine step (services/decode/stream_mux.py),
where a call per stream cost a message per stream per step on both sides.

A stream's error comes as its last piece's status; the call's failure (the worker died, its
connection dropped) ends every stream open on it with the call's error, as each of their own
calls would have ended."""
from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from protos import duet_pb2, duet_pb2_grpc
from shared.wire.stream_end import end_error, rpc_error

log = logging.getLogger("duet.gateway.streams")

_CALL_ENDED = object()  # the call ended with no error while the stream was still open


class MuxedStream:
    """One Generate stream of a GenerateMux (what `DecodeStub.Generate(...)` returned)."""

    def __init__(self, mux: "GenerateMux", stream_id: int):
        self._mux, self.stream_id = mux, stream_id
        self._pieces: asyncio.Queue = asyncio.Queue()
        self._ended = False

    def _put(self, item) -> None:
        self._pieces.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> duet_pb2.TokenChunk:
        while not self._ended:
            item = await self._pieces.get()
            if isinstance(item, grpc.aio.AioRpcError):
                self._ended = True
                raise item
            if item is _CALL_ENDED:
                self._ended = True
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the decode worker ended the streams' call")
            if item.end:
                self._ended = True
                self._mux._forget(self.stream_id)
                error = end_error(item)
                if error is not None:
                    raise error
            if item.HasField("chunk"):
                return item.chunk
        raise StopAsyncIteration

    def cancel(self) -> bool:
        """The caller left: the worker ends the stream and frees its pages."""
        if self._ended:
            return False
        self._ended = True
        self._mux._cancel(self.stream_id)
        return True


class GenerateMux:
    """Every Generate stream this gateway has open on one decode worker (one channel)."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = duet_pb2_grpc.DecodeStub(channel)
        self._ids = itertools.count(1)
        self._streams: dict[int, MuxedStream] = {}
        self._outgoing: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self.calls = self.replies = self.pieces = 0  # calls opened, messages and pieces received

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def open(self, request: duet_pb2.GenerateRequest, metadata=()) -> MuxedStream:
        """Start a Generate stream; metadata: the trace context pairs a Generate call carried."""
        if self._reader is None or self._reader.done():
            self._start_call()
        stream = MuxedStream(self, next(self._ids))
        self._streams[stream.stream_id] = stream
        self._outgoing.put_nowait(duet_pb2.StreamsRequest(stream_id=stream.stream_id, generate=request,
                                                          trace_context=dict(metadata)))
        return stream

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def _start_call(self) -> None:
        outgoing = self._outgoing = asyncio.Queue()
        self.calls += 1

        async def requests():
            while True:
                yield await outgoing.get()
        self._reader = asyncio.ensure_future(self._read(self._stub.GenerateStreams(requests())))

    async def _read(self, call) -> None:
        streams = self._streams
        failure: object = _CALL_ENDED
        try:
            async for reply in call:
                self.replies += 1
                self.pieces += len(reply.pieces)
                for piece in reply.pieces:
                    stream = streams.get(piece.stream_id)
                    if stream is not None:  # else cancelled by us meanwhile
                        stream._put(piece)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            call.cancel()
            failure = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed its decode streams")
            raise
        finally:
            # every stream still open on this call ends with it; the next open starts a new call
            ended, self._streams = list(streams.values()), {}
            if self._reader is asyncio.current_task():
                self._reader = None
            for stream in ended:
                stream._put(failure)

    def _forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    def _cancel(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None and self._outgoing is not None:
            self._outgoing.put_nowait(duet_pb2.StreamsRequest(stream_id=stream_id, cancel=True))

