"""API keys: `Authorization: Bearer KEY` on every route except the open ones.

Keys come from --api-key / DUET_API_KEYS and from a file with one key per line
(DUET_API_KEYS_FILE, a mounted Kubernetes Secret), which is re-read when it changes, so a
rotated Secret takes effect without a restart. Only SHA-256 digests are kept; a presented
key is hashed and compared with every digest by hmac.compare_digest, with no early exit,
so timing says nothing about which key or how much of one matched. Keys are never logged.

The check is plain ASGI middleware, in front of routing and body parsing: a request without
a valid key is answered 401 (OpenAI's error JSON, code invalid_api_key) before anything
reads its body, tokenizes or talks to the router or workers. A request that passes carries
its key's digest (scope state `tenant`), by which admission shares the workers fairly and
each tenant gets a prefix cache of its own (cache_namespace.py)."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from services.gateway.http_edge.error_responses import APIError

log = logging.getLogger("duet.gateway.auth")

# Probes and Prometheus need no key: /health (readiness), /live (liveness), /metrics.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
RECHECK_S = 5.0  # how often the keys file is stat()ed for a change

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
           "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_name(key: bytes) -> str:
    """The tenant a key stands for, as admission and the cache namespaces know it: a digest."""
    return "key-" + _digest(key).hex()[:16]


def _valid_key(key: str) -> bool:
    # what can arrive in an HTTP header as one token: visible ASCII, no spaces
    return bool(key) and all(0x21 <= ord(c) <= 0x7E for c in key)


def parse_keys_text(text: str, source: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    keys = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _valid_key(line):  # the message names the line, never its content
            raise ValueError(f"{source} line {n}: not a valid API key (printable ASCII without spaces)")
        keys.append(line)
    return keys


@dataclass
class ApiKeyStore:
    static_keys: Sequence[str] = field(default=(), repr=False)
    keys_file: str | None = None
    recheck_s: float = RECHECK_S

    def __post_init__(self) -> None:
        for i, key in enumerate(self.static_keys):
            if not _valid_key(key):
                raise ValueError(f"API key #{i + 1} from --api-key/DUET_API_KEYS is not printable ASCII "
                                 "without spaces")
        self._static = [_digest(k.encode()) for k in self.static_keys]
        self._from_file: list[bytes] = []
        self._stamp: tuple | None = None
        self._last_check = time.monotonic()
        if self.keys_file:
            self._load_file(initial=True)
        if not self.count:
            raise ValueError(f"no API keys configured (the keys file {self.keys_file} has none)")

    @property
    def count(self) -> int:
        return len(self._static) + len(self._from_file)

    def matches(self, presented: bytes) -> bool:
        self._maybe_reload()
        candidate = _digest(presented)
        ok = False
        for digest in (*self._static, *self._from_file):
            ok |= hmac.compare_digest(digest, candidate)  # no early exit
        return ok

    def _maybe_reload(self) -> None:
        if not self.keys_file:
            return
        now = time.monotonic()
        if now - self._last_check < self.recheck_s:
            return
        self._last_check = now
        try:
            self._load_file(initial=False)
        except ValueError as exc:  # keep serving with the keys we have
            log.warning("API keys file not reloaded, keeping the previous keys: %s", exc)

    def _load_file(self, initial: bool) -> None:
        try:
            st = os.stat(self.keys_file)  # follows the ..data symlink a Secret volume swaps
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.keys_file) as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {self.keys_file}: {exc.strerror or exc}") from None
        keys = parse_keys_text(text, f"API keys file {self.keys_file}")
        if not keys and not initial:
            raise ValueError(f"the API keys file {self.keys_file} has no keys now")
        self._from_file = [_digest(k.encode()) for k in keys]
        self._stamp = stamp
        if not initial:
            log.info("API keys reloaded from %s: %d keys", self.keys_file, len(keys))


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else b""
    return None


class ApiKeyMiddleware:
    """ASGI middleware: 401 for a missing or wrong key, before routing (no work is done)."""

    def __init__(self, app, store: ApiKeyStore, rejected: Counter | None = None):
        self.app = app
        self.store = store
        self.rejected = rejected

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers", ()))
        if token and self.store.matches(token):
            # admission shares the workers fairly across keys, each key has a prefix cache of its own
            scope.setdefault("state", {})["tenant"] = tenant_name(token)
            return await self.app(scope, receive, send)
        reason = "missing" if token is None else "invalid"
        if self.rejected is not None:
            self.rejected.labels(reason).inc()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        error = APIError(401, MISSING if token is None else INCORRECT, "invalid_request_error", None,
                         "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def install(app, store: ApiKeyStore, registry: CollectorRegistry | None = None) -> None:
    """Put the key check in front of everything the app serves."""
    rejected = Counter("duet_gateway_auth_failures", "Requests refused for a missing or wrong API key",
                       ["reason"], registry=registry) if registry is not None else None
    app.add_middleware(ApiKeyMiddleware, store=store, rejected=rejected)
