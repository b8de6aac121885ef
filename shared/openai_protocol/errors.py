"""The one error type request parsing raises; the HTTP layer turns it into OpenAI's error JSON."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request is malformed or asks for something unsupported (HTTP 400 unless status says)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
