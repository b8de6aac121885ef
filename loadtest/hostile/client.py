"""The probes' view of the server: authenticated HTTP calls that never raise, and raw sockets
for what an HTTP client library will not send."""
from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx


@dataclass
class Reply:
    status: int | str | None  # HTTP status, or "timeout" / an exception's name
    body: bytes | None
    latency_s: float
    headers: dict[str, str] | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"")
        except ValueError:
            return None

    def head(self, limit: int = 300) -> str:
        return (self.body or b"")[:limit].decode("utf-8", "replace")

    @property
    def prompt_tokens(self) -> int | None:
        doc = self.json()
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if not isinstance(usage, dict):
            return None
        return usage.get("prompt_tokens", usage.get("input_tokens"))


@dataclass
class Server:
    """Where the gateway is and how to talk to it."""

    base_url: str  # without /v1
    api_key: str | None = None
    model: str = ""

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.base_url)
        return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)

    def client(self, timeout_s: float, connections: int = 64) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.auth_headers, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=connections, max_keepalive_connections=8),
                                 verify=False)

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None, timeout_s: float = 30.0) -> Reply:
        """POST JSON (or raw bytes) on a client of its own; a timeout or a dropped connection is a Reply too."""
        content = raw if raw is not None else json.dumps(body).encode()
        started = time.monotonic()
        async with self.client(timeout_s) as http:
            try:
                r = await http.post(path, content=content, headers={"Content-Type": "application/json"})
                return Reply(r.status_code, r.content, time.monotonic() - started, dict(r.headers))
            except httpx.TimeoutException:
                return Reply("timeout", None, time.monotonic() - started)
            except httpx.HTTPError as exc:
                return Reply(type(exc).__name__, None, time.monotonic() - started)

    async def raw_exchange(self, request: bytes, timeout_s: float = 10.0) -> Reply:
        """Send bytes on a fresh TCP connection and parse the one HTTP answer that comes back.
        Blocking sockets in a thread: a server may answer (and close, resetting the send)
        before it has taken all of an oversized request, and the answer must still be read
        (asyncio's stream reader drops buffered data once the write side failed)."""
        return await asyncio.to_thread(self._raw_exchange, request, timeout_s)

    def _raw_exchange(self, request: bytes, timeout_s: float) -> Reply:
        started = time.monotonic()
        try:
            sock = socket.create_connection(self.host_port, timeout=timeout_s)
            if urlsplit(self.base_url).scheme == "https":
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                sock = context.wrap_socket(sock, server_hostname=self.host_port[0])
        except OSError as exc:
            return Reply(type(exc).__name__, None, time.monotonic() - started)
        with sock:
            try:
                sock.sendall(request)
            except OSError:
                pass  # the server stopped reading; its answer may still be there
            data = b""
            try:
                while not _complete(data):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except TimeoutError:
                if not data:
                    return Reply("timeout", None, time.monotonic() - started)
            except OSError as exc:
                if not data:
                    return Reply(type(exc).__name__, None, time.monotonic() - started)
        return _parse_response(data, time.monotonic() - started)


def _complete(data: bytes) -> bool:
    """A whole answer: headers, then Content-Length bytes or a chunked body's last chunk."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip() or 0)
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            return body.endswith(b"0\r\n\r\n")
    return False  # read until the server closes


def _parse_response(data: bytes, latency_s: float) -> Reply:
    if not data.startswith(b"HTTP/"):
        return Reply("no HTTP answer" if not data else "garbled answer", data or None, latency_s)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    return Reply(status, body, latency_s, headers)


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
        except ValueError:
            return out + body  # not chunked after all: keep what is there
        if size == 0:
            break
        out, body = out + rest[:size], rest[size + 2:]
    return out


def chat_body(model: str, content: str = "Say hi.", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, **extra}


def completion_body(model: str, prompt: Any = "Say hi.", **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
