"""Server-sent events, and noticing that the client left.

Starlette's StreamingResponse only notices a disconnect when it next writes (ASGI 2.4)
or through its own listener (2.3), and never runs cleanup for a body generator that
had not started yet. Work here is expensive (KV pages, a decode slot), so we watch for
`http.disconnect` ourselves, cancel the producer at once, and always run `on_close`.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(obj: Any, named: bool = False) -> bytes:
    """One SSE event; named: an `event:` line with the object's type (Responses API)."""
    data = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return b"event: " + obj["type"].encode() + b"\n" + data if named else data


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable) -> Any:
    """Await `work`, but cancel it (and wait for its cleanup) if the client disconnects
    first; then raise ClientDisconnected. Used before any response byte is sent."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise ClientDisconnected()
    finally:
        for task in (watcher, work_task):
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task


class EventStreamResponse(Response):
    """text/event-stream whose producer is cancelled as soon as the client disconnects.

    on_close(disconnected) runs exactly once, after the body ended, failed or was cancelled.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]],
                 headers: dict[str, str] | None = None):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        producer = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                try:
                    producer.result()
                except OSError:  # the socket went away while writing
                    disconnected = True
            else:
                disconnected = True
        finally:
            for task in (watcher, producer):
                if not task.done():
                    task.cancel()
                    with suppress(asyncio.CancelledError, OSError):
                        await task
            with suppress(Exception):
                await self.events.aclose()
            await self.on_close(disconnected)

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
