"""The JSON Schema keywords structured outputs enforce, and the check that refuses the rest.

xgrammar (the grammar engine) turns a schema into a grammar and silently drops what it cannot
express, so the output would break the schema while the request claims it was enforced.
What xgrammar 0.2.8 enforces was measured: for each keyword, grammars made from schemas
using it, tested against values the schema accepts and values it refuses (the cases are kept
in tests/gateway/test_json_schema_support.py, which re-runs them against the installed
xgrammar). Allowed here is what it enforces; the rest is refused with the keyword and its
place, the way OpenAI's strict mode lists what it supports. Annotations (title, description,
default, ...) and keywords JSON Schema does not define pass: no validator enforces them.

Narrowing is fine (every output still matches): an object gets only its listed properties
unless additionalProperties says otherwise, a pattern matches the whole string, a format
that is no standard one (OpenAPI's "int64") is an annotation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.openai_protocol.json_schema_oneof import overlapping_pair
from shared.openai_protocol.json_schema_recursion import endless_ref
from shared.openai_protocol.json_schema_refs import BadRef, resolve
from shared.openai_protocol.json_schema_walk import (
    JSON_TYPES,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    TYPED_KEYWORDS,
    fits_type,
    is_schema,
    join,
    node_types,
    subschemas,
)

_NOT_ENFORCED = "the grammar engine does not enforce it"
REFUSED = {
    "not": "a schema's complement cannot be generated",
    "if": "conditional schemas are not enforced", "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "dependentSchemas": _NOT_ENFORCED, "dependentRequired": _NOT_ENFORCED, "dependencies": _NOT_ENFORCED,
    "contains": _NOT_ENFORCED, "minContains": _NOT_ENFORCED, "maxContains": _NOT_ENFORCED,
    "additionalItems": "use prefixItems and items",
    "$anchor": "refer by a JSON pointer ('#/$defs/name')", "$dynamicRef": _NOT_ENFORCED,
    "$dynamicAnchor": _NOT_ENFORCED, "$recursiveRef": _NOT_ENFORCED, "$recursiveAnchor": _NOT_ENFORCED,
}
COMBINERS = ("$ref", "anyOf", "oneOf", "allOf")
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
# standard formats xgrammar lets any string through for
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
# every other keyword (title, description, default, examples, $defs, $comment, content*, and
# any JSON Schema does not define) is an annotation: allowed anywhere, enforced by no one
_KNOWN = frozenset(REFUSED) | frozenset(COMBINERS) | frozenset(TYPED_KEYWORDS) | {"type", "const", "enum"}


@dataclass(frozen=True)
class SchemaProblem:
    keyword: str
    path: str  # where, as $.properties.a
    why: str

    def __str__(self) -> str:
        return f"keyword '{self.keyword}' at {self.path} {self.why}"


def schema_problem(schema: Any) -> SchemaProblem | None:
    """The first thing in the schema the grammar engine would not enforce, or None: keywords
    in document order, then overlapping oneOf branches, then recursion with no way to end.
    Iterative, linear in the schema's size; only what the root reaches is read."""
    if not is_schema(schema):
        return SchemaProblem("schema", "$", "must be a JSON schema (an object or a boolean)")
    nodes: list[tuple[dict[str, Any], str]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str, bool]] = [(schema, "$", False)]  # (node, path, it is a propertyNames schema)
    while stack:
        node, path, names = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append((node, path))
        problem = _node_problem(node, path, node is schema, names)
        if problem is not None:
            return problem
        children = [(child, join(path, *steps), steps == ("propertyNames",)) for steps, child in subschemas(node)]
        if "$ref" in node:
            try:
                children.append((*resolve(schema, node["$ref"]), names))
            except BadRef as exc:
                return SchemaProblem("$ref", path, str(exc))
        stack.extend(reversed(children))

    def target(ref: Any) -> Any:
        return resolve(schema, ref)[0]

    shapes: dict = {}
    for node, path in nodes:
        if isinstance(node.get("oneOf"), list):
            pair = overlapping_pair(node["oneOf"], target, shapes)
            if pair is not None:
                return SchemaProblem("oneOf", path, f"is not enforced: a value may match both branch {pair[0]} "
                                     f"and {pair[1]} (only provably disjoint branches are: different types, "
                                     "const/enum values, or a required property with different const values); "
                                     "use anyOf")
    ref_path = endless_ref(nodes, target)
    if ref_path is not None:
        return SchemaProblem("$ref", ref_path, "makes the schema recurse with no way to end: no finite JSON value "
                             "matches it; give the recursion a way out (an optional property, anyOf with null, "
                             "an array that may be empty)")
    return None


def _node_problem(node: dict[str, Any], path: str, is_root: bool, names: bool) -> SchemaProblem | None:
    """names: node is (or is referred to from) a propertyNames schema, so it is about strings."""
    for key, value in node.items():
        if key in REFUSED:
            return SchemaProblem(key, path, f"is not supported ({REFUSED[key]})")
        if key == "uniqueItems" and value is not False:
            return SchemaProblem(key, path, f"is not supported ({_NOT_ENFORCED})")
        if key == "$id" and not is_root:
            return SchemaProblem(key, path, "is only supported at the root (it would change what $ref means below it)")
        if (key in SCHEMA_LISTS and not (isinstance(value, list) and value and all(map(is_schema, value)))) or \
                (key in SCHEMA_MAPS and not (isinstance(value, dict) and all(map(is_schema, value.values())))):
            return SchemaProblem(key, path, "must hold " + ("a non-empty list of" if key in SCHEMA_LISTS else
                                                            "an object of") + " schemas")
        if key in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames") \
                and not is_schema(value):
            why = " (a list is draft 4's tuple form: use prefixItems)" if key == "items" else ""
            return SchemaProblem(key, path, f"must be a schema{why}")
    combiners = [k for k in COMBINERS if k in node]
    if combiners:
        return _combiner_problem(node, path, combiners)
    if "const" in node or "enum" in node:
        return _values_problem(node, path)
    return _typed_problem(node, path, names)


def _beside(node: dict[str, Any], path: str, first: str, allowed: set[str], why: str) -> SchemaProblem | None:
    for key in node:
        if key != first and key in _KNOWN and key not in allowed:
            return SchemaProblem(key, path, f"is not enforced beside '{first}' ({why})")
    return None


def _combiner_problem(node: dict[str, Any], path: str, combiners: list[str]) -> SchemaProblem | None:
    first = combiners[0]
    problem = _beside(node, path, first, set(), f"the grammar engine reads only the '{first}'; "
                      f"move the keyword into {'the schema it refers to' if first == '$ref' else 'each branch'}")
    if problem is not None:
        return problem
    if first == "allOf" and len(node["allOf"]) > 1:
        return SchemaProblem("allOf", path, "with more than one schema is not supported (the grammar engine does "
                             "not intersect them); merge them into one schema")
    return None


def _values_problem(node: dict[str, Any], path: str) -> SchemaProblem | None:
    first = "const" if "const" in node else "enum"
    problem = _beside(node, path, first, {"type"}, f"the output is one of the {first} values as given")
    if problem is not None:
        return problem
    values = [node["const"]] if first == "const" else node["enum"]
    if not isinstance(values, list) or not values:
        return SchemaProblem("enum", path, "must be a non-empty list")
    problem = _type_problem(node, path)
    if problem is not None:
        return problem
    declared = node.get("type")
    types = frozenset([declared] if isinstance(declared, str) else declared if isinstance(declared, list) else [])
    for value in values if types else ():
        if not fits_type(value, types):
            return SchemaProblem(first, path, f"value {value!r} is not of type {declared!r}, and would be output")
    return None


def _type_problem(node: dict[str, Any], path: str) -> SchemaProblem | None:
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if declared is not None and not (names and all(isinstance(t, str) and t in JSON_TYPES for t in names)):
        return SchemaProblem("type", path, f"must be one of {sorted(JSON_TYPES)} or a non-empty list of them")
    return None


def _typed_problem(node: dict[str, Any], path: str, names: bool) -> SchemaProblem | None:
    problem = _type_problem(node, path)
    if problem is not None:
        return problem
    types = node_types(node) or (frozenset({"string"}) if names else None)
    if types is None:
        typed = next((k for k in node if k in TYPED_KEYWORDS), None)
        if typed is not None:
            return SchemaProblem(typed, path, "needs a 'type' beside it (without one the grammar engine does not "
                                 "enforce it)")
        return None
    if "string" in types:
        problem = _string_problem(node, path)
        if problem is not None:
            return problem
    if "multipleOf" in node and ("number" in types or not _positive_int(node["multipleOf"])):
        return SchemaProblem("multipleOf", path, "is only supported on integers (type 'integer'), "
                             "as a positive whole number")
    return _object_problem(node, path) if "object" in types else None


def _string_problem(node: dict[str, Any], path: str) -> SchemaProblem | None:
    """One of a format, a pattern or a length is enforced on a string, never two."""
    fmt = node.get("format")
    fmt = fmt if isinstance(fmt, str) else None  # else: not a format (the compile says so)
    if fmt in UNENFORCED_FORMATS:
        return SchemaProblem("format", path, f"{fmt!r} is not supported; supported formats: "
                             f"{', '.join(sorted(ENFORCED_FORMATS))}")
    leader = "format" if fmt in ENFORCED_FORMATS else "pattern" if "pattern" in node else None
    for key in ("pattern", "minLength", "maxLength") if leader else ():
        if key != leader and key in node:
            return SchemaProblem(key, path, f"is not enforced beside '{leader}' (the grammar engine applies one "
                                 f"of format, pattern and length); put it into a pattern")
    return None


def _object_problem(node: dict[str, Any], path: str) -> SchemaProblem | None:
    props = node.get("properties") or {}
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return SchemaProblem("required", path, "must be a list of property names")
    for name in required:
        if name not in props:
            return SchemaProblem("required", path, f"names {name!r}, which is not in 'properties' (the grammar "
                                 "engine writes only listed properties, so it would be left out)")
    patterns = node.get("patternProperties")
    if patterns is not None and "properties" in node:
        return SchemaProblem("patternProperties", path, "is not enforced beside 'properties' (a listed property "
                             "that matches a pattern is not checked against it)")
    if patterns is not None and len(patterns) > 1:
        return SchemaProblem("patternProperties", path, "with more than one pattern is not supported (a name that "
                             "matches two is checked against one)")
    if "propertyNames" in node and ("properties" in node or patterns is not None):
        other = "properties" if "properties" in node else "patternProperties"
        return SchemaProblem("propertyNames", path, f"is not enforced beside '{other}'")
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
