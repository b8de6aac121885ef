"""What the HTTP parser refuses (a bad chunk size, a malformed request or header line,
headers past h11's size bound) is answered as OpenAI error JSON, like everything else the
gateway refuses, instead of uvicorn's plain-text "Invalid HTTP request received.". The
status is h11's hint: 431 for oversized headers, 501 for an unsupported transfer coding,
else 400. The connection is closed after it, as uvicorn does."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES

CODES = {431: "headers_too_large", 501: "not_implemented"}


class RecordingConnection(h11.Connection):
    """An h11 connection that keeps the last protocol error it raised (uvicorn drops it)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


def error_body(exc: h11.RemoteProtocolError | None) -> tuple[int, bytes]:
    status = exc.error_status_hint if exc is not None and 400 <= exc.error_status_hint < 600 else 400
    detail = str(exc) if exc is not None and str(exc) else "malformed request"
    body = {"error": {"message": f"Invalid HTTP request: {detail}.", "type": "invalid_request_error",
                      "param": None, "code": CODES.get(status, "invalid_http_request")}}
    return status, json.dumps(body).encode()


class JsonParserErrors:
    """Mixin for uvicorn's H11Protocol (before it in the bases)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        old = self.conn
        self.conn = RecordingConnection(h11.SERVER, old._max_incomplete_event_size)

    def send_400_response(self, msg: str) -> None:  # uvicorn's name; the status may be 431 or 501
        status, body = error_body(getattr(self.conn, "last_error", None))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
