"""Validate objects against OpenAI's own response schemas (the copy in tests/helpers/data/openai).

`validate(obj, "CreateChatCompletionResponse")` raises jsonschema.ValidationError when
`obj` does not match. The copy is OpenAPI 3.1 with some OpenAPI 3.0 leftovers: a
`nullable: true` keyword means "or null", which plain JSON Schema ignores, so it is
rewritten to `anyOf: [schema, {type: null}]` on load.

One derived schema is added here, not in the copy: "CreateCompletionStreamResponse".
The spec says completion stream chunks share CreateCompletionResponse's shape, yet
OpenAI's live API (and every client) sends `finish_reason: null` on all chunks but
the last, which that schema forbids; the derived one allows null there and nothing else.

And "CreateCompletionResponseEcho": with `echo` and `logprobs`, the first prompt token has
no logprob, and OpenAI's API (like vLLM) answers null for it in token_logprobs and
top_logprobs, which the spec's number/object items forbid; the derived schema allows
null items there and nothing else.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMA_FILE = Path(__file__).parent / "data" / "openai" / "schemas.json"
DOCUMENT_URI = "urn:duet:openai-schemas"


def _rewrite_nullable(node):
    if isinstance(node, list):
        return [_rewrite_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: _rewrite_nullable(sub) for name, sub in value.items()}
        else:
            out[key] = _rewrite_nullable(value)
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _completion_stream_schema(schemas: dict) -> dict:
    derived = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish = derived["properties"]["choices"]["items"]["properties"]["finish_reason"]
    derived["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [finish, {"type": "null"}]
    }
    return derived


def _completion_echo_schema(schemas: dict) -> dict:
    derived = copy.deepcopy(schemas["CreateCompletionResponse"])
    logprobs = derived["properties"]["choices"]["items"]["properties"]["logprobs"]["anyOf"][0]["properties"]
    for key in ("token_logprobs", "top_logprobs"):
        logprobs[key]["items"] = {"anyOf": [logprobs[key]["items"], {"type": "null"}]}
    return derived


@lru_cache(maxsize=1)
def _document() -> dict:
    raw = json.loads(SCHEMA_FILE.read_text())
    schemas = _rewrite_nullable(raw["components"]["schemas"])
    schemas["CreateCompletionStreamResponse"] = _completion_stream_schema(schemas)
    schemas["CreateCompletionResponseEcho"] = _completion_echo_schema(schemas)
    return {"components": {"schemas": schemas}}


@lru_cache(maxsize=None)
def _validator(schema_name: str) -> jsonschema.protocols.Validator:
    document = _document()
    if schema_name not in document["components"]["schemas"]:
        raise KeyError(f"no schema {schema_name!r} in {SCHEMA_FILE}")
    registry = Registry().with_resource(DOCUMENT_URI, Resource(contents=document, specification=DRAFT202012))
    schema = {"$ref": f"{DOCUMENT_URI}#/components/schemas/{schema_name}"}
    cls = jsonschema.Draft202012Validator
    return cls(schema, registry=registry, format_checker=cls.FORMAT_CHECKER)


def schema_names() -> list[str]:
    return sorted(_document()["components"]["schemas"])


def validate(obj, schema_name: str) -> None:
    """Raise jsonschema.ValidationError (the most relevant one) if obj does not match."""
    validator = _validator(schema_name)
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        raise error


def is_valid(obj, schema_name: str) -> bool:
    return _validator(schema_name).is_valid(obj)


@lru_cache(maxsize=1)
def _response_event_schemas() -> dict[str, str]:
    """Responses API stream event type ("response.created") -> its schema's name."""
    schemas = _document()["components"]["schemas"]
    out = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        kind = schemas[name].get("properties", {}).get("type", {}).get("enum", [None])[0]
        if kind:
            out[kind] = name
    return out


def validate_response_event(event: dict) -> None:
    """Validate a Responses stream event against the schema of its own type (the union's
    errors would not say what is wrong), and against the union."""
    name = _response_event_schemas().get(event.get("type"))
    if name is None:
        raise jsonschema.ValidationError(f"unknown Responses stream event type {event.get('type')!r}")
    validate(event, name)
    validate(event, "ResponseStreamEvent")
