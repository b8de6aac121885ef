"""Structured outputs: the grammar a request needs, if any: from response_format (chat;
text.format in the Responses API: json_object / json_schema), or from a forced tool_choice
("required": a list of calls to the given functions, vLLM's shape; a named function: its
arguments). `checked` then has the GrammarGuard judge it within the server's limits (a
helper process, a time budget): a schema with keywords the grammar engine would not enforce
(shared/openai_protocol/json_schema_support.py), one that cannot compile, not in time, or to
a grammar no output can begin, is a 400 naming the problem and where it is in the request,
before any worker is asked. "required" checks each function's schema on its own first, so
the error names the function."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.engine.grammar_guard import GrammarGuard
from shared.engine.grammar_spec import GrammarError, GrammarSpec
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.json_schema_refs import has_refs, rebase_refs
from shared.openai_protocol.tools import named_choice, parameters_param, tool_function

EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class RequestGrammar:
    spec: GrammarSpec
    param: str  # the request field it came from (the 400's param)
    where: str  # the schema's place in the request (a 400's message starts with it)
    parts: tuple["RequestGrammar", ...] = ()  # schemas inside spec, checked first on their own


def response_format_grammar(fmt: dict[str, Any] | None, param: str = "response_format",
                            where: str = "response_format.json_schema.schema") -> RequestGrammar | None:
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return RequestGrammar(GrammarSpec("json_object"), param, param)
    schema = fmt["json_schema"].get("schema")
    if not schema:
        return RequestGrammar(GrammarSpec("json_object"), param, param)
    return RequestGrammar(GrammarSpec("json_schema", json.dumps(schema)), param, where)


def tool_choice_grammar(tools: list[dict[str, Any]], choice, parallel: bool | None,
                        flat: bool = False) -> RequestGrammar | None:
    """None for "auto"/"none"; the forced shape for "required" or a named function."""
    name = named_choice(choice, flat)
    if name is not None:
        i = next(i for i, t in enumerate(tools) if tool_function(t, flat)["name"] == name)
        where = parameters_param(i, flat)
        schema = tool_function(tools[i], flat).get("parameters") or EMPTY_OBJECT
        return RequestGrammar(GrammarSpec("json_schema", json.dumps(schema)), where, where)
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [tool_function(t, flat)["name"]]},
        "parameters": _placed(tool_function(t, flat).get("parameters") or EMPTY_OBJECT, f"tool_{i}", defs)},
        "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    parts = tuple(RequestGrammar(GrammarSpec("json_schema", json.dumps(params)), parameters_param(i, flat),
                                 parameters_param(i, flat))
                  for i, t in enumerate(tools) if (params := tool_function(t, flat).get("parameters")))
    return RequestGrammar(GrammarSpec("json_schema", json.dumps(schema)), "tools", "tools", parts)


def _placed(parameters: dict[str, Any], name: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema as placed in the "required" list's schema: as it is, or,
    when it has $refs (which point into it, "#" its root), moved to $defs.<name> with its
    refs rebased there (the list's schema is the root now)."""
    if not has_refs(parameters):
        return parameters
    defs[name] = rebase_refs(parameters, f"/$defs/{name}")
    return {"$ref": f"#/$defs/{name}"}


async def checked(guard: GrammarGuard, grammar: RequestGrammar | None) -> GrammarSpec | None:
    if grammar is None:
        return None
    for part, keywords_only in [*((p, True) for p in grammar.parts), (grammar, False)]:
        try:
            await guard.check(part.spec, keywords_only=keywords_only)
        except GrammarError as exc:
            raise InvalidRequest(f"{part.where}: {exc}", part.param) from None
    return grammar.spec
