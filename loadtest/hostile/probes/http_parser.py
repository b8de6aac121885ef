"""Checklist item 8 (second half): what the HTTP parser refuses must still be OpenAI error JSON
(a client library shows `error.message`; plain text makes it guess). Raw sockets, because
no HTTP client library sends these."""
from __future__ import annotations

from collections.abc import Callable

from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, client_error_json


def _head(ctx: ProbeContext, method: str, path: str, *extra: str) -> bytes:
    host, port = ctx.server.host_port
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in ctx.server.auth_headers.items()]
    lines += list(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def bad_chunk_size(ctx: ProbeContext) -> bytes:
    return _head(ctx, "POST", "/v1/chat/completions", "Content-Type: application/json",
                 "Transfer-Encoding: chunked") + b"zz\r\n{}\r\n0\r\n\r\n"


def oversized_headers(kib: int) -> Callable[[ProbeContext], bytes]:
    return lambda ctx: _head(ctx, "GET", "/v1/models", "X-Pad: " + "a" * (kib * 1024))


def bad_request_line(ctx: ProbeContext) -> bytes:
    return b"GET /v1/models HTTP/1.1 trailing-garbage\r\nHost: x\r\n\r\n"


def bad_header_line(ctx: ProbeContext) -> bytes:
    return _head(ctx, "GET", "/v1/models", "this line has no colon")


def invalid_json(ctx: ProbeContext) -> bytes:
    body = b'{"messages": ['
    return _head(ctx, "POST", "/v1/chat/completions", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close") + body


def wrong_method(ctx: ProbeContext) -> bytes:
    return _head(ctx, "GET", "/v1/chat/completions", "Connection: close")


CASES: dict[str, tuple[Callable[[ProbeContext], bytes], str]] = {
    "bad_chunk_size": (bad_chunk_size, "400 JSON"),
    "oversized_headers_100k": (oversized_headers(100), "431 JSON"),
    "oversized_headers_1m": (oversized_headers(1024), "431 JSON"),
    "bad_request_line": (bad_request_line, "400 JSON"),
    "bad_header_line": (bad_header_line, "400 JSON"),
    "invalid_json_body": (invalid_json, "400 JSON"),
    "wrong_method": (wrong_method, "405 JSON"),
}


def _case_probe(name: str, make: Callable[[ProbeContext], bytes], expect: str) -> Probe:
    async def run(ctx: ProbeContext, r: ProbeResult) -> None:
        reply = await ctx.server.raw_exchange(make(ctx), timeout_s=10)
        r.record_reply(reply)
        r.details["content_type"] = (reply.headers or {}).get("content-type")

    return Probe(f"http_{name}", "8", expect, run, client_error_json, timeout_s=15.0)


PROBES = [_case_probe(name, make, expect) for name, (make, expect) in CASES.items()]
