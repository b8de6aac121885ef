"""uvicorn, hardened against slow and oversized clients (connection bounds from GatewayLimits,
limits_config.py; request headers and bodies are request_guard.py's).

uvicorn's h11 protocol bounds the size of a request's headers (h11_max_incomplete_event_size)
and closes idle keep-alive connections (timeout_keep_alive), but it starts no clock while
a request's headers are arriving: a client that opens a connection and trickles a header
byte every few seconds (slowloris) holds it forever. GuardedH11Protocol adds that clock:
from the connection's opening, and on a kept-alive connection from the next request's first
byte, the request's headers must be complete within header_timeout_s or the connection is
closed. An idle kept-alive connection is timeout_keep_alive's alone, and that is set well
above the idle expiry of common clients (httpx, and so the openai SDK, drop idle
connections after 5 s): whoever closes an idle connection first must be the client, or a
request it sends just as the server closes fails with a connection error. The h11 protocol is
named explicitly (not "auto") so these limits hold whatever else is installed. What its
parser refuses is answered as OpenAI error JSON (parser_errors.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.parser_errors import JsonParserErrors

log = logging.getLogger("duet.gateway")


class GuardedH11Protocol(JsonParserErrors, H11Protocol):
    header_timeout_s: float = 10.0  # set on the subclass guarded_h11() makes

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # A kept-alive connection's clock starts at the next request's first byte: while it
        # sits idle only timeout_keep_alive may close it (see the module note).
        if self._awaiting_headers() and self._header_timer is None:
            self._arm_header_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._awaiting_headers():
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Part of a pipelined next request already buffered: its clock starts now.
        if self._awaiting_headers() and self.conn.trailing_data[0] and self._header_timer is None:
            self._arm_header_timer()

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request headers within %gs",
                     self.client, self.header_timeout_s)
            self.transport.close()


def guarded_h11(header_timeout_s: float) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_limits(limits: GatewayLimits) -> dict[str, Any]:
    """uvicorn.run / uvicorn.Config keyword arguments that apply the connection limits."""
    return {"http": guarded_h11(limits.header_timeout_s), "timeout_keep_alive": limits.keep_alive_s,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
