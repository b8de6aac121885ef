"""oneOf as xgrammar enforces it: a value must match exactly one branch, but xgrammar only
generates "at least one" (anyOf), warning on stderr when it cannot prove the branches
disjoint. So a oneOf is taken only when no value can match two of its branches, proven here
the simple ways: different JSON types, different const/enum values, or objects told apart
by a required property whose const/enum values differ (a discriminator)."""
from __future__ import annotations

import json
from typing import Any, Callable

from shared.openai_protocol.json_schema_walk import JSON_TYPES, node_types, value_type

Resolve = Callable[[Any], Any]  # a $ref -> the schema it points at


def overlapping_pair(branches: list[Any], resolve: Resolve, memo: dict[int, "_Shape"]) -> tuple[int, int] | None:
    """Two branches some value may match both of, or None when they are disjoint. Branches are
    compared per JSON type (linear in their number, not quadratic). memo: shared by the calls
    on one schema, so each subschema's shape is found once."""
    shapes = [_Shape.of(_deref(b, resolve), resolve, memo) for b in branches]
    by_type: dict[str, list[int]] = {}
    for i, shape in enumerate(shapes):
        for kind in shape.types:
            by_type.setdefault(kind, []).append(i)
    for kind, members in sorted(by_type.items()):
        if len(members) > 1:
            pair = _clash(kind, [shapes[i] for i in members], resolve, memo)
            if pair is not None:
                return members[pair[0]], members[pair[1]]
    return None


def _clash(kind: str, shapes: list["_Shape"], resolve: Resolve,
           memo: dict[int, "_Shape"]) -> tuple[int, int] | None:
    """Two of shapes (all of type kind) that may share a value of that type, or None."""
    if all(shape.values is not None for shape in shapes):
        return _shared_key([[key for key, t in shape.values.items() if t == kind] for shape in shapes])
    if kind == "object" and all(shape.values is None and isinstance(shape.node, dict) for shape in shapes):
        for name in sorted(set.intersection(*(_required(shape.node) for shape in shapes))):
            values = [_property_values(shape.node, name, resolve, memo) for shape in shapes]
            if all(v is not None for v in values) and _shared_key([list(v) for v in values]) is None:
                return None  # a discriminator: its values tell every branch apart
    return 0, 1


def _shared_key(keys: list[list[str]]) -> tuple[int, int] | None:
    owner: dict[str, int] = {}
    for k, group in enumerate(keys):
        for key in set(group):
            if key in owner:
                return owner[key], k
            owner[key] = k
    return None


def _deref(node: Any, resolve: Resolve) -> Any:
    seen = set()
    while isinstance(node, dict) and "$ref" in node and id(node) not in seen:
        seen.add(id(node))
        node = resolve(node["$ref"])
    return node


def _value_key(value: Any) -> str:
    """Equal JSON values, equal keys (1 and 1.0 alike; true and 1 not)."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


class _Shape:
    """What a branch can be: its JSON types (a number type includes the integers) and, for a
    const/enum, its values (value key -> its JSON type)."""

    def __init__(self, node: Any, types: frozenset[str], values: dict[str, str] | None):
        self.node, self.types, self.values = node, types, values

    @classmethod
    def of(cls, node: Any, resolve: Resolve, memo: dict[int, "_Shape"]) -> "_Shape":
        """memo: shapes found so far by node (also ends a cycle: a node met again while its
        own shape is still being found counts as any type)."""
        if node is False:
            return cls(node, frozenset(), None)
        if not isinstance(node, dict):
            return cls(node, JSON_TYPES, None)
        if id(node) not in memo:
            memo[id(node)] = cls(node, JSON_TYPES, None)
            memo[id(node)] = cls._find(node, resolve, memo)
        return memo[id(node)]

    @classmethod
    def _find(cls, node: dict[str, Any], resolve: Resolve, memo: dict[int, "_Shape"]) -> "_Shape":
        values = node.get("enum") if "enum" in node else [node["const"]] if "const" in node else None
        if isinstance(values, list):
            keyed = {_value_key(v): value_type(v) for v in values}
            return cls(node, frozenset(keyed.values()), keyed)
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                types = frozenset().union(*(cls.of(_deref(b, resolve), resolve, memo).types for b in node[key]))
                return cls(node, types, None)
        types = node_types(node) or JSON_TYPES
        return cls(node, types | {"integer"} if "number" in types else types, None)


def _required(node: dict[str, Any]) -> set[str]:
    required = node.get("required")
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _property_values(node: dict[str, Any], name: str, resolve: Resolve,
                     memo: dict[int, "_Shape"]) -> dict[str, str] | None:
    props = node.get("properties")
    if not isinstance(props, dict):
        return None
    return _Shape.of(_deref(props.get(name), resolve), resolve, memo).values
