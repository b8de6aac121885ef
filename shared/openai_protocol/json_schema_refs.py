"""$ref inside one schema, the way xgrammar resolves it: "#" (the root) or a JSON pointer
"#/a/b" through object keys only (xgrammar 0.2.8 finds neither list indices, "~0"/"~1"
escapes nor %-escapes, and no other document). A schema placed inside a larger one (the
tool calls that tool_choice "required" forces) has its refs rebased onto its new place."""
from __future__ import annotations

import copy
from typing import Any

from shared.openai_protocol.json_schema_walk import join, subschemas


class BadRef(ValueError):
    """Why a $ref cannot be followed (the message completes "'$ref' ...")."""


def resolve(root: Any, ref: Any) -> tuple[Any, str]:
    """(the schema `ref` points at in root, its path for messages); BadRef if none."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise BadRef("must point into this schema: '#' or a JSON pointer such as '#/$defs/name'")
    if "~" in ref or "%" in ref:
        raise BadRef("pointers with ~ or % escapes are not supported; give the definition a plain name")
    node, path = root, "$"
    for key in ref[2:].split("/") if ref != "#" else ():
        if not isinstance(node, dict) or key not in node:
            raise BadRef(f"{ref!r} points at nothing in this schema (a pointer goes through object keys only)")
        node, path = node[key], join(path, key)
    return node, path


def has_refs(schema: Any) -> bool:
    return any(True for _ in _ref_holders(schema))


def rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of schema whose refs point into it at its new place, `pointer` ("/$defs/x")
    within the enclosing schema."""
    out = copy.deepcopy(schema)
    for node in _ref_holders(out):
        node["$ref"] = "#" + pointer + node["$ref"][1:]
    return out


def _ref_holders(schema: Any):
    """Every subschema (including $defs and definitions) that has a local $ref, once."""
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            yield node
        stack.extend(child for _, child in subschemas(node))
        for defs in ("$defs", "definitions"):
            if isinstance(node.get(defs), dict):
                stack.extend(node[defs].values())
