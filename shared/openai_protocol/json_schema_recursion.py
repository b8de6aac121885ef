"""Recursion with no way out: a $ref cycle that every value must go around again, such as
{"$ref": "#"} or an object whose required property is the object itself. No finite JSON
value matches such a schema, and xgrammar builds a grammar that either allows no first token
(the worker then fails with "token 0 does not fit the grammar") or never lets the value end
(the model writes until max_tokens). Found here before any compile: a schema node can end
when one of its alternatives can, an alternative when all that it requires can (what a value
must contain: required properties, the first minItems items, a $ref's target, an allOf's
members, one anyOf/oneOf branch), computed as the least fixed point over the whole schema in
time linear in its size."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from shared.openai_protocol.json_schema_walk import node_types

Resolve = Callable[[Any], Any]  # a $ref -> the schema it points at


def endless_ref(nodes: list[tuple[dict[str, Any], str]], resolve: Resolve) -> str | None:
    """The path of the first $ref (in the order of nodes) through which no finite value
    exists, or None. nodes: every object schema reachable from the root, with its path."""
    ends: set[int] = set()
    waiting: dict[int, list[tuple[int, int]]] = defaultdict(list)  # child -> (parent, alternative)
    missing: dict[tuple[int, int], int] = {}
    ready: list[int] = []
    for node, _ in nodes:
        for k, needs in enumerate(_alternatives(node, resolve)):
            if any(child is False for child in needs):
                continue  # `false` matches nothing: this alternative never ends
            ids = {id(child) for child in needs if isinstance(child, dict)}
            if not ids:
                if id(node) not in ends:
                    ends.add(id(node))
                    ready.append(id(node))
                continue
            missing[(id(node), k)] = len(ids)
            for child in ids:
                waiting[child].append((id(node), k))
    while ready:
        child = ready.pop()
        for parent, k in waiting.pop(child, ()):
            missing[(parent, k)] -= 1
            if missing[(parent, k)] == 0 and parent not in ends:
                ends.add(parent)
                ready.append(parent)
    return next((path for node, path in nodes if "$ref" in node and id(node) not in ends), None)


def _alternatives(node: dict[str, Any], resolve: Resolve) -> list[list[Any]]:
    """What a finite value of node needs: any one of the lists, all of a list's schemas."""
    if "$ref" in node:
        return [[resolve(node["$ref"])]]
    for key in ("anyOf", "oneOf"):
        if key in node:
            return [[branch] for branch in node[key]]
    if "allOf" in node:
        return [list(node["allOf"])]
    if "const" in node or "enum" in node:
        return [[]]
    types = node_types(node)
    if not types:
        return [[]]
    return [_needs(node, t) for t in sorted(types)]


def _needs(node: dict[str, Any], kind: str) -> list[Any]:
    if kind == "object":
        props = node.get("properties") or {}
        return [props[name] for name in node.get("required") or () if name in props]
    if kind == "array":
        least = node.get("minItems")
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0  # else: the compile's 400
        prefix = list(node.get("prefixItems") or ())
        needs = prefix[:least]
        if least > len(prefix):
            needs.append(node.get("items", True))
        return needs
    return []
