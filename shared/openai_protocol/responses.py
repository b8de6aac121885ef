"""Request body of POST /v1/responses (OpenAI's Responses API), stateless.

`input` is a string or a list of items: messages ({"role", "content"} with text or
input_text/output_text parts, with or without "type": "message"), function_call items
and function_call_output items; `instructions` become the first system message. They
are turned into chat messages and served like a chat completion. Nothing is stored, so
`previous_response_id` is refused with a 400 that says so."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from protos.wire_ranges import INT32_MAX
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import _parse, _range, check_cache_salt
from shared.openai_protocol.tools import check_response_format, check_tool_choice, check_tools


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextOptions(_Body):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    text: TextOptions | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: a prefix cache apart from requests without it

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: this server stores no responses; "
                                 "send the whole conversation in `input`", "previous_response_id")
        _range("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        check_cache_salt(self.cache_salt)
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequest(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                                 "max_output_tokens")
        _range("max_output_tokens", self.max_output_tokens, 1, INT32_MAX)
        check_tools(self.tools, flat=True)
        check_tool_choice(self.tool_choice, self.tools, flat=True)
        check_response_format(self.format, "text.format", schema_at="text.format.schema")
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequest("input must not be empty", "input")
        self.chat_messages()  # raises on items it cannot take

    @property
    def format(self) -> dict[str, Any] | None:
        """text.format in chat's response_format shape (the Responses API flattens json_schema)."""
        fmt = self.text.format if self.text else None
        if not fmt or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    @property
    def effective_tool_choice(self):
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            param = f"input[{i}]"
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise InvalidRequest(f"Invalid role {role!r}", f"{param}.role")
                messages.append({"role": role, "content": _text(item.get("content"), param)})
            elif kind == "function_call":
                _string(item, "name", param, required=True)
                for key in ("call_id", "id", "arguments"):
                    _string(item, key, param)
                call = {"id": item.get("call_id") or item.get("id") or f"call_{i}", "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                _string(item, "call_id", param)
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _text(output, param, "output")})
            else:
                raise InvalidRequest(f"input items of type {kind!r} are not supported", f"{param}.type")
        if not messages:
            raise InvalidRequest("input must not be empty", "input")
        return messages


def _string(item: dict, key: str, param: str, required: bool = False) -> None:
    value = item.get(key)
    if (value is None and required) or (value is not None and not isinstance(value, str)):
        raise InvalidRequest(f"{key} must be a string", f"{param}.{key}")


def _text(content, param: str, field: str = "content") -> str:
    """A message's content, or a function_call_output's output (field), as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{field} must be a string or a list of text parts", f"{param}.{field}")
    out = []
    for j, part in enumerate(content):
        if (not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)):
            raise InvalidRequest("only text content parts (input_text) are supported", f"{param}.{field}[{j}]")
        out.append(part["text"])
    return "".join(out)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    request = _parse(ResponsesRequest, body)
    request.check()
    return request
