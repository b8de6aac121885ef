"""/openapi.json: the gateway's routes with their request bodies described.

The endpoints read the raw body and parse it themselves (shared/openai_protocol: strict
types, OpenAI-style messages naming the parameter), so FastAPI cannot see the body
models. Here the pydantic models' JSON schemas are put into the document (components,
a requestBody per route) and the documented answers (200, and the OpenAI error object
for 4xx/5xx) are added, so clients and fuzzers (tests/test_gateway_fuzz.py) know what
to send and what to expect."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from shared.openai_protocol.requests import ChatCompletionRequest, CompletionRequest
from shared.openai_protocol.responses import ResponsesRequest

REF = "#/components/schemas/{model}"
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ERROR_STATUSES = {"400": "Invalid request", "404": "Unknown model", "408": "Body not received in time",
                  "413": "Body too large", "431": "Headers too large", "429": "At capacity; see Retry-After",
                  "503": "No worker can serve now"}


def install_openapi(app: FastAPI) -> None:
    """Serve the described document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version="1", routes=app.routes,
                      description="OpenAI-compatible API of the Duet gateway")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, model in BODIES.items():
        post = doc["paths"].get(path, {}).get("post")
        if post is None:
            continue
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        post["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=model.__name__)}}}}
        error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
        post["responses"] = {
            "200": {"description": "The answer (JSON), or a stream of server-sent events when stream is true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{code: {"description": text, **error} for code, text in ERROR_STATUSES.items()},
        }
    return doc
