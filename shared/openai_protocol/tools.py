"""Checks of the function-calling and structured-output fields (tools, tool_choice,
response_format), with OpenAI's parameter names in the messages. Only shapes are checked
here; whether the grammar engine enforces a schema (json_schema_support.py) and compiles it
is decided off the event loop, within the grammar limits (gateway: openai_api/structured_outputs.py)."""
from __future__ import annotations

import re
from typing import Any

from shared.openai_protocol.errors import InvalidRequest

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def check_tools(tools: list[dict[str, Any]] | None, param: str = "tools", flat: bool = False) -> None:
    """Chat tools are {"type": "function", "function": {name, description, parameters}};
    the Responses API's (flat=True) carry name/parameters at the top level."""
    for i, tool in enumerate(tools or []):
        where = f"{param}[{i}]"
        if tool.get("type") != "function":
            raise InvalidRequest(f"only tools of type 'function' are supported, got {tool.get('type')!r}",
                                 f"{where}.type")
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest("Missing required parameter: 'function'", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise InvalidRequest("function names must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                                 f"{where}.function.name" if not flat else f"{where}.name")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise InvalidRequest("function parameters must be a JSON schema of type object",
                                 f"{where}.function.parameters" if not flat else f"{where}.parameters")
    names = [tool_function(t, flat)["name"] for t in tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequest("function names must be unique", param)


def tool_function(tool: dict[str, Any], flat: bool = False) -> dict[str, Any]:
    return tool if flat else tool["function"]


def check_tool_choice(choice, tools: list[dict[str, Any]] | None, flat: bool = False) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                                 "tool_choice")
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", "tool_choice")
        return
    name = named_choice(choice, flat)
    if name is None:
        raise InvalidRequest("tool_choice must name a function: {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}", "tool_choice")
    if name not in [tool_function(t, flat)["name"] for t in tools or []]:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")


def parameters_param(index: int, flat: bool = False) -> str:
    """Where tool `index`'s parameter schema is in the request (an error's param)."""
    return f"tools[{index}].parameters" if flat else f"tools[{index}].function.parameters"


def named_choice(choice, flat: bool = False) -> str | None:
    """The function a dict tool_choice names (chat: nested under "function"; Responses: flat)."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    name = choice.get("name") if flat or "function" not in choice else (choice.get("function") or {}).get("name")
    return name if isinstance(name, str) else None


def check_response_format(fmt: dict[str, Any] | None, param: str = "response_format",
                          schema_at: str | None = None) -> None:
    """schema_at: where the schema is in the request (default: param.json_schema.schema)."""
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                             f"{param}.type")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequest("json_schema needs a name and a schema", f"{param}.json_schema")
        where = schema_at or f"{param}.json_schema.schema"
        if not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("json_schema.schema must be a JSON schema object", where)
