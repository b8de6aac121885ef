"""Requests, bounded (ASGI middleware; the limits are GatewayLimits, limits_config.py).

Headers over `max_header_bytes` get 431 (h11's own bound applies only while headers are
incomplete across reads, so a whole oversized block that arrives in one read passes it). A
body over `max_bytes` gets 413 (by Content-Length before a byte of it is read, or as soon
as a chunked body passes the limit) and one not fully received within `timeout_s` gets
408, both as OpenAI error JSON, and the connection is closed. The endpoints buffer the
whole body anyway (it is parsed as one JSON document), so reading it here first costs
nothing; the app then gets it replayed as one message, and later receive() calls
(disconnect watching) pass through."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.http_edge.error_responses import APIError

_WITH_BODY = ("POST", "PUT", "PATCH")


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    "invalid_request_error", None, "request_too_large", {"Connection": "close"})


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body was not received within {seconds:g}s.",
                    "invalid_request_error", None, "request_timeout", {"Connection": "close"})


def headers_too_large(limit: int) -> APIError:
    return APIError(431, f"The request headers are larger than this server accepts ({limit} bytes).",
                    "invalid_request_error", None, "headers_too_large", {"Connection": "close"})


class RequestLimitsMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, max_header_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.max_header_bytes:
            await headers_too_large(self.max_header_bytes).response()(scope, receive, send)
            return
        if scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _TooLarge:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        except asyncio.TimeoutError:
            await body_timeout(self.timeout_s).response()(scope, receive, send)
            return
        except _Disconnected:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses a malformed one before we see it
    return None
