"""OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from services.gateway.backends.interface import BackendBadRequest, BackendBusy, BackendError, BackendUnavailable
from shared.openai_protocol.errors import InvalidRequest


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def sse_event(self) -> bytes:
        """The error as one SSE event, for a stream that already started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                    "model_not_found")


def not_found(path: str) -> APIError:
    return APIError(404, f"Not found: {path}", "invalid_request_error", None, "not_found")


def internal_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def server_busy(message: str, retry_after_s: float | None) -> APIError:
    """429 in OpenAI's format; Retry-After in whole seconds, at least 1."""
    headers = {} if retry_after_s is None else {"Retry-After": str(max(1, round(retry_after_s)))}
    return APIError(429, f"The server is at capacity: {message}. Retry later.", "rate_limit_error", None,
                    "server_busy", headers)


def from_invalid_request(exc: InvalidRequest) -> APIError:
    return APIError(exc.status, exc.message, "invalid_request_error", exc.param, exc.code)


def from_backend_error(exc: BackendError) -> APIError:
    if isinstance(exc, BackendBusy):
        return server_busy(str(exc), exc.retry_after_s)
    if isinstance(exc, BackendUnavailable):
        return APIError(503, f"The service is unavailable: {exc}", "server_error", None, "service_unavailable")
    if isinstance(exc, BackendBadRequest):
        return APIError(400, str(exc), "invalid_request_error", exc.param, None)
    return internal_error(f"Backend failure: {exc}")
