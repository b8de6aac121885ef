"""The shape of a JSON schema as the structured-outputs check reads it: which keywords hold
subschemas, which belong to which JSON type, the types a node stands for (as xgrammar reads
it), and how a place in a schema is written in an error ($.properties.a)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "string", "integer", "number"})
STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems")
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                   "minProperties", "maxProperties", "unevaluatedProperties")
TYPED_KEYWORDS = STRING_KEYWORDS + NUMBER_KEYWORDS + ARRAY_KEYWORDS + OBJECT_KEYWORDS

# keywords whose value is one subschema, a list of them, or a map of them
ONE_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties")

_PLAIN_KEY = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")


def join(path: str, *steps: str | int) -> str:
    """path extended by keys (.key, or ["odd key"]) and list indices ([i])."""
    for step in steps:
        if isinstance(step, int):
            path += f"[{step}]"
        elif _PLAIN_KEY.match(step):
            path += f".{step}"
        else:
            path += '["' + step.replace("\\", "\\\\").replace('"', '\\"') + '"]'
    return path


def is_schema(value: Any) -> bool:
    return isinstance(value, (dict, bool))


def subschemas(node: dict[str, Any]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(steps from node, value) of each place in node that holds a subschema, in key order;
    the values are not checked to be schemas. $ref targets and $defs are not among them."""
    for key, value in node.items():
        if key in ONE_SCHEMA:
            yield (key,), value
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, child in enumerate(value):
                yield (key, i), child
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            for name, child in value.items():
                yield (key, name), child


def node_types(node: dict[str, Any]) -> frozenset[str] | None:
    """The JSON types xgrammar generates for a node that has no $ref, anyOf, oneOf, allOf,
    const or enum: its `type`, or object when it has properties or additionalProperties,
    array when it has items or prefixItems; None when it can be anything (then xgrammar
    enforces none of the type-specific keywords: measured, see json_schema_support.py)."""
    declared = node.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    if "properties" in node or "additionalProperties" in node:
        return frozenset({"object"})
    if "items" in node or "prefixItems" in node:
        return frozenset({"array"})
    return None


def value_type(value: Any) -> str:
    """The JSON type of a value; a whole number is an integer (1.0 too, as in JSON Schema)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def fits_type(value: Any, types: frozenset[str]) -> bool:
    kind = value_type(value)
    return kind in types or (kind == "integer" and "number" in types)
