"""The gateway's limits against hostile load, over a real uvicorn server with the gateway's
own connection settings (services/gateway/http_edge/connection_guard.py): bounded admission
(429 with Retry-After in OpenAI's error format, never an unbounded pile), request bodies
over the size limit (413) or too slow (408), a slowloris client that trickles its headers is
dropped, idle keep-alive connections close, oversized headers are refused.

The backend is a ScriptedBackend with slow tokens (what holds an admission slot); the
admission queue itself is also checked directly for its races (cancel while queued, a
slot granted just as the wait times out)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.http_edge.admission import AdmissionQueue, AdmissionRefused
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.connection_guard import uvicorn_limits
from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.openai_schema import validate
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir, wait_until

MODEL = "tiny"
CONTEXT = 256
LIMITS = GatewayLimits(max_concurrent=2, max_queued=2, queue_timeout_s=5.0, retry_after_s=3.0,
                       max_body_bytes=4096, body_timeout_s=1.0, header_timeout_s=1.0, keep_alive_s=0.5,
                       max_header_bytes=8192)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT))


@pytest.fixture(scope="module")
def backend(prompts):
    return ScriptedBackend(script=prompts.tokenizer.encode("slow words", add_special_tokens=False),
                           eos_token_id=prompts.tokenizer.eos_token_id, max_context_len=CONTEXT)


@pytest.fixture(scope="module")
def ctx(prompts, backend):
    return GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT, limits=LIMITS)


@pytest.fixture(scope="module")
def server(ctx):
    with UvicornThread(build_app(ctx), **uvicorn_limits(LIMITS)) as srv:
        yield srv


@pytest.fixture
def idle(backend, ctx):
    """Each test starts with fast tokens and no admitted request; and leaves none behind."""
    backend.delay_s = 0.0
    yield
    assert wait_until(lambda: ctx.admission.active == 0 and ctx.admission.queued == 0, 10), ctx.admission.stats()


def completion(stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": stream, **extra}


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    validate(body, "ErrorResponse")
    assert body["error"]["code"] == code, body
    return body


# --- admission -----------------------------------------------------------------------------


def test_beyond_running_plus_queued_requests_get_429_with_retry_after(server, backend, ctx, idle):
    backend.delay_s = 0.15  # ~12 tokens: each request holds its slot ~1.8 s

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            async def one(i):
                return await http.post("/v1/completions", json=completion(stream=i % 2 == 1))
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.to_thread(wait_until, lambda: ctx.admission.active == 2 and ctx.admission.queued == 2, 5)
            assert (ctx.admission.active, ctx.admission.queued) == (2, 2)
            return await asyncio.gather(*tasks)
    responses = asyncio.run(go())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 4 + [429] * 4, statuses
    for r in responses:
        if r.status_code == 429:
            body = assert_openai_error(r, 429, "server_busy")
            assert body["error"]["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "3"
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'duet_requests_total{endpoint="completions",outcome="rejected",service="gateway",status="429"} 4.0' \
        in metrics
    assert "duet_gateway_refused_requests" in metrics


def test_a_request_waits_no_longer_than_the_queue_timeout(prompts, backend, idle):
    limits = GatewayLimits(max_concurrent=1, max_queued=4, queue_timeout_s=0.4)
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT, limits=limits)
    backend.delay_s = 0.2  # the first request holds the only slot ~2.5 s

    async def go(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            first = asyncio.create_task(http.post("/v1/completions", json=completion()))
            await asyncio.to_thread(wait_until, lambda: ctx.admission.active == 1, 5)
            started = time.monotonic()
            second = await http.post("/v1/completions", json=completion())
            waited = time.monotonic() - started
            return await first, second, waited
    with UvicornThread(build_app(ctx)) as srv:
        first, second, waited = asyncio.run(go(srv.base_url))
    assert first.status_code == 200
    assert_openai_error(second, 429, "server_busy")
    assert 0.3 < waited < 2.0, waited
    assert (ctx.admission.active, ctx.admission.queued) == (0, 0)


def test_a_client_that_leaves_while_queued_gives_up_its_place(server, backend, ctx, idle):
    backend.delay_s = 0.1

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            running = [asyncio.create_task(http.post("/v1/completions", json=completion())) for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: ctx.admission.active == 2, 5)
            queued = asyncio.create_task(http.post("/v1/completions", json=completion()))
            await asyncio.to_thread(wait_until, lambda: ctx.admission.queued == 1, 5)
            queued.cancel()  # the client goes away while it waits
            await asyncio.to_thread(wait_until, lambda: ctx.admission.queued == 0, 5)
            assert ctx.admission.queued == 0
            return await asyncio.gather(*running)
    assert [r.status_code for r in asyncio.run(go())] == [200, 200]


def test_admission_queue_races():
    async def go():
        q = AdmissionQueue(max_concurrent=1, max_queued=1, queue_timeout_s=0.05)
        a = q.ticket()
        await a.acquire()
        b = q.ticket()
        with pytest.raises(AdmissionRefused):  # waits 50 ms, then refused
            await b.acquire()
        assert (q.active, q.queued, q.refused) == (1, 0, 1)
        # a waiter cancelled while queued leaves no trace; the next one gets the slot
        q.queue_timeout_s = 5.0
        c = q.ticket()
        task = asyncio.create_task(c.acquire())
        await asyncio.sleep(0.01)
        assert q.queued == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        d = q.ticket()
        waiting = asyncio.create_task(d.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionRefused):  # the queue (1) is full
            await q.ticket().acquire()
        a.release()
        a.release()  # idempotent
        await waiting
        assert (q.active, q.queued) == (1, 0)
        # granted and cancelled in the same turn: the slot is passed on, not lost
        e = q.ticket()
        task = asyncio.create_task(e.acquire())
        await asyncio.sleep(0.01)
        d.release()  # grants e's waiter ...
        task.cancel()  # ... which is cancelled before it runs
        try:
            await task  # asyncio may complete it anyway (the grant won): then e holds the slot
            assert q.active == 1
            e.release()
        except asyncio.CancelledError:
            pass
        assert (q.active, q.queued) == (0, 0)
        unbounded = AdmissionQueue(0, 0, 0)
        tickets = [unbounded.ticket() for _ in range(1000)]
        for t in tickets:
            await t.acquire()
        assert unbounded.active == 1000
    asyncio.run(go())


# --- bodies ------------------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413(server, idle):
    big = completion(prompt="x" * 5000)
    r = httpx.post(server.base_url + "/v1/completions", json=big, timeout=10)  # Content-Length
    assert_openai_error(r, 413, "request_too_large")

    def chunks():  # chunked: no Content-Length, refused once past the limit
        for _ in range(10):
            yield b" " * 1000
    r = httpx.post(server.base_url + "/v1/chat/completions", content=chunks(), timeout=10,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "request_too_large")
    r = httpx.post(server.base_url + "/v1/completions", json=completion(), timeout=10)
    assert r.status_code == 200  # the server still serves


def test_a_body_that_trickles_gets_408(server, idle):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        started = time.monotonic()
        reply = _read_until_closed(s, 5)
    assert b" 408 " in reply.split(b"\r\n", 1)[0], reply
    assert b"request_timeout" in reply
    assert 0.8 < time.monotonic() - started < 4


# --- connections --------------------------------------------------------------------------


def test_a_slowloris_client_is_dropped(server, idle):
    """Headers trickled a byte every 0.2 s never complete within the header timeout (1 s):
    the server closes the connection (uvicorn alone would wait forever)."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        started = time.monotonic()
        closed_after = None
        for byte in request:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.2)
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        closed_after = time.monotonic() - started
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            except OSError:
                closed_after = time.monotonic() - started
                break
    assert closed_after is not None and 0.8 < closed_after < 3.0, closed_after
    assert httpx.get(server.base_url + "/v1/models").status_code == 200


def test_idle_keep_alive_closes_and_big_headers_are_refused(server, idle):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        reply = _read_until_closed(s, 5)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert 0.3 < time.monotonic() - started < 3  # keep-alive 0.5 s (and header timeout 1 s)
    r = httpx.get(server.base_url + "/v1/models", headers={"X-Big": "b" * 20000})  # one read
    assert_openai_error(r, 431, "headers_too_large")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:  # across reads: h11's bound
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(10):
            s.sendall(b"b" * 1000)
            time.sleep(0.01)
        reply = _read_until_closed(s, 5)
    # h11's refusal, as OpenAI error JSON with h11's status (parser_errors.py)
    assert reply.startswith(b"HTTP/1.1 431"), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"


def test_an_idle_kept_alive_connection_is_only_the_keep_alive_timeouts(ctx, idle):
    """With keep-alive (3 s) above the header timeout (1 s), an idle connection after a response
    stays open past the header timeout and serves the next request (a client's pool reuses it:
    the server closing it first is what fails a request with a connection error); a request
    then trickled on that connection is still dropped about a header timeout after its first
    byte."""
    limits = GatewayLimits(header_timeout_s=1.0, keep_alive_s=3.0)
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with UvicornThread(build_app(ctx), **uvicorn_limits(limits)) as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(request)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(1.8)  # idle past the header timeout, inside keep-alive
        s.sendall(request)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # then nothing more
        started = time.monotonic()
        assert _read_until_closed(s, 5) == b""
        assert 0.8 < time.monotonic() - started < 1.8  # the header timeout, not keep-alive's 3 s


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /v1/models HTTP/1.1 trailing-garbage\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nthis line has no colon\r\n\r\n",
], ids=["bad_chunk_size", "bad_request_line", "bad_header_line"])
def test_what_the_http_parser_refuses_is_openai_error_json(server, idle, raw):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(raw)
        reply = _read_until_closed(s, 5)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), reply
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert error["error"]["code"] == "invalid_http_request" and "Invalid HTTP request" in error["error"]["message"]


def _read_until_closed(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return out
        if not data:
            return out
        out += data


# --- configuration -------------------------------------------------------------------------


def test_limit_flags_and_env():
    env = {"DUET_MAX_CONCURRENT_REQUESTS": "7", "DUET_MAX_QUEUED_REQUESTS": "9", "DUET_MAX_BODY_BYTES": "1000",
           "DUET_HEADER_TIMEOUT": "2.5"}
    limits = GatewayConfig.from_argv(["--queue-timeout", "4", "--keep-alive-timeout", "3"], env).limits
    assert (limits.max_concurrent, limits.max_queued, limits.max_body_bytes, limits.header_timeout_s,
            limits.queue_timeout_s, limits.keep_alive_s) == (7, 9, 1000, 2.5, 4.0, 3.0)
    assert GatewayConfig.from_argv([], {}).limits == GatewayLimits()
    with pytest.raises(ValueError):
        GatewayLimits(max_queued=-1)
    with pytest.raises(ValueError):
        GatewayLimits(header_timeout_s=0)
    options = uvicorn_limits(limits)
    assert options["timeout_keep_alive"] == 3.0 and options["h11_max_incomplete_event_size"] == limits.max_header_bytes
    assert options["http"].header_timeout_s == 2.5


def _read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length body, leaving the connection open."""
    s.settimeout(5)
    out = b""

    def more() -> bytes:
        data = s.recv(65536)
        assert data, f"the server closed the connection (after {out!r})"
        return data
    while b"\r\n\r\n" not in out:
        out += more()
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += more()
    return out
