"""Structured outputs: the grammar a request needs, if any: from response_format (chat;
text.format in the Responses API: json_object / json_schema), or from a forced tool_choice
("required": a list of calls to the given functions, vLLM's shape; a named function: its
arguments). `checked` then has the GrammarGuard compile it within the server's limits (a
helper process, a time budget), so a schema that cannot compile, or not in time, is a 400
naming the problem before any worker is asked."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.engine.grammar_guard import GrammarGuard
from shared.engine.grammar_spec import GrammarError, GrammarSpec
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.tools import named_choice, tool_function

EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class RequestGrammar:
    spec: GrammarSpec
    param: str  # the request field it came from (the 400's param)


def response_format_grammar(fmt: dict[str, Any] | None, param: str = "response_format") -> RequestGrammar | None:
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return RequestGrammar(GrammarSpec("json_object"), param)
    schema = fmt["json_schema"].get("schema")
    if not schema:
        return RequestGrammar(GrammarSpec("json_object"), param)
    return RequestGrammar(GrammarSpec("json_schema", json.dumps(schema)), f"{param}.json_schema.schema")


def tool_choice_grammar(tools: list[dict[str, Any]], choice, parallel: bool | None,
                        flat: bool = False) -> RequestGrammar | None:
    """None for "auto"/"none"; the forced shape for "required" or a named function."""
    name = named_choice(choice, flat)
    if name is not None:
        fn = next(tool_function(t, flat) for t in tools if tool_function(t, flat)["name"] == name)
        return RequestGrammar(GrammarSpec("json_schema", json.dumps(fn.get("parameters") or EMPTY_OBJECT)), "tools")
    if choice != "required":
        return None
    items = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [tool_function(t, flat)["name"]]},
        "parameters": tool_function(t, flat).get("parameters") or EMPTY_OBJECT},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    return RequestGrammar(GrammarSpec("json_schema", json.dumps(schema)), "tools")


async def checked(guard: GrammarGuard, grammar: RequestGrammar | None) -> GrammarSpec | None:
    if grammar is None:
        return None
    try:
        await guard.check(grammar.spec)
    except GrammarError as exc:
        raise InvalidRequest(str(exc), grammar.param) from None
    return grammar.spec
