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


def overlapping_pair(branches: list[Any], resolve: Resolve) -> tuple[int, int] | None:
    """The first two branches some value may match both of, or None when they are disjoint."""
    shapes = [_Shape.of(_deref(b, resolve), resolve) for b in branches]
    for i in range(len(shapes)):
        for j in range(i + 1, len(shapes)):
            if not shapes[i].disjoint(shapes[j], resolve):
                return i, j
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
    const/enum, its values."""

    def __init__(self, node: Any, types: frozenset[str], values: frozenset[str] | None):
        self.node, self.types, self.values = node, types, values

    @classmethod
    def of(cls, node: Any, resolve: Resolve, depth: int = 0) -> "_Shape":
        if node is False:
            return cls(node, frozenset(), None)
        if not isinstance(node, dict) or depth > 32:
            return cls(node, JSON_TYPES, None)
        values = node.get("enum") if "enum" in node else [node["const"]] if "const" in node else None
        if isinstance(values, list):
            return cls(node, frozenset(value_type(v) for v in values), frozenset(_value_key(v) for v in values))
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                types = frozenset().union(*(cls.of(_deref(b, resolve), resolve, depth + 1).types
                                            for b in node[key]))
                return cls(node, types, None)
        types = node_types(node) or JSON_TYPES
        return cls(node, types | {"integer"} if "number" in types else types, None)

    def disjoint(self, other: "_Shape", resolve: Resolve) -> bool:
        common = self.types & other.types
        if not common:
            return True
        if self.values is not None and other.values is not None:
            return not self.values & other.values
        return common == {"object"} and _discriminated(self.node, other.node, resolve)


def _discriminated(a: dict[str, Any], b: dict[str, Any], resolve: Resolve) -> bool:
    """Both objects require a property whose const/enum values differ between them."""
    for name in _required(a) & _required(b):
        va, vb = _property_values(a, name, resolve), _property_values(b, name, resolve)
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _required(node: dict[str, Any]) -> set[str]:
    required = node.get("required")
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _property_values(node: dict[str, Any], name: str, resolve: Resolve) -> frozenset[str] | None:
    props = node.get("properties")
    if not isinstance(props, dict):
        return None
    return _Shape.of(_deref(props.get(name), resolve), resolve).values
