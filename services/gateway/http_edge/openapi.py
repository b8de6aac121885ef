"""/openapi.json: the gateway's routes with their request bodies described.

The endpoints read the raw body and parse it themselves (shared/openai_protocol: strict
types, OpenAI-style messages naming the parameter), so FastAPI cannot see the body
models. Here the pydantic models' JSON schemas are put into the document (components,
a requestBody per route) and the documented answers (200, and the OpenAI error object
for 4xx/5xx) are added, so clients and fuzzers (tests/gateway/test_gateway_fuzz.py) know what
to send and what to expect."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from protos.wire_ranges import FLOAT32_MAX, INT32_MAX, SEED_MAX, SEED_MIN
from shared.openai_protocol.requests import (CHAT_ROLES, MAX_N, MAX_TOP_LOGPROBS, ChatCompletionRequest,
                                            CompletionRequest)
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


# Ranges and shapes that the models' check() enforces, stated in the document (the
# pydantic models give only the JSON types): each the range the whole path carries (the gRPC
# contract's int32 / uint64 / float32 included). Applied to the non-null branch of a field.
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_SAMPLING = {
    "temperature": {"minimum": 0, "maximum": 2}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "n": {"minimum": 1, "maximum": MAX_N}, "max_tokens": {"minimum": 1, "maximum": INT32_MAX},
    "seed": {"minimum": SEED_MIN, "maximum": SEED_MAX},
    "frequency_penalty": {"minimum": -2, "maximum": 2}, "presence_penalty": {"minimum": -2, "maximum": 2},
    "min_p": {"minimum": 0, "maximum": 1}, "top_k": {"minimum": -1, "maximum": INT32_MAX},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": FLOAT32_MAX},
    "stop": {"string": {"minLength": 1}, "array": {"items": {"type": "string", "minLength": 1}}},
    "stop_token_ids": {"items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}},
    "logit_bias": {"propertyNames": {"pattern": "^[0-9]{1,5}$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
}
CONSTRAINTS: dict[str, dict[str, dict]] = {
    "ChatCompletionRequest": {
        **_SAMPLING, "messages": {"minItems": 1}, "max_completion_tokens": {"minimum": 1, "maximum": INT32_MAX},
        "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "tool_choice": {"string": {"enum": ["none", "auto"]}},
        "response_format": {"required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    },
    "CompletionRequest": {
        **_SAMPLING,
        "prompt": {"replace": {"anyOf": [  # required by check(); token ids must also be < the vocabulary
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                     "items": {"type": "integer", "minimum": 0}}}]}},
        "logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS}, "suffix": {"maxLength": 0},
    },
    # content: required (the server also takes an assistant message without it, with tool_calls)
    "ChatMessage": {"role": {"enum": list(CHAT_ROLES)},
                    "content": {"replace": {"anyOf": [{"type": "string"},
                                                      {"type": "array", "items": _TEXT_PART}]}},
                    "tool_calls": {"items": {"type": "object", "required": ["function"], "properties": {
                        "id": {"type": "string"}, "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}}},
    "ResponsesRequest": {"temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                         "max_output_tokens": {"minimum": 1, "maximum": INT32_MAX},
                         "input": {"string": {"minLength": 1}}},
}


def _constrain(schemas: dict[str, Any]) -> None:
    for model, fields in CONSTRAINTS.items():
        props = schemas.get(model, {}).get("properties", {})
        for name, extra in fields.items():
            if name not in props:
                continue
            if "replace" in extra:  # a required field of this shape
                props[name] = extra["replace"]
                schemas[model].setdefault("required", []).append(name)
                continue
            by_kind = "string" in extra or "array" in extra
            for branch in props[name].get("anyOf", [props[name]]):
                kind = branch.get("type")
                if kind is None or kind == "null":
                    continue
                if by_kind:
                    branch.update(extra.get(kind, {}))
                else:
                    branch.update(extra)


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
    _constrain(schemas)
    return doc
