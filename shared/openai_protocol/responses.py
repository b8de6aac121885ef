"""Request body of POST /v1/responses (OpenAI's Responses API), stateless.

`input` is a string or a list of items: messages ({"role", "content"} with text or
input_text/output_text parts, with or without "type": "message"), function_call items
and function_call_output items; `instructions` become the first system message. They
are turned into chat messages and served like a chat completion. Nothing is stored, so
`previous_response_id` is refused with a 400 that says so."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import _parse, _range
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

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: this server stores no responses; "
                                 "send the whole conversation in `input`", "previous_response_id")
        _range("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequest(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                                 "max_output_tokens")
        check_tools(self.tools, flat=True)
        check_tool_choice(self.tool_choice, self.tools, flat=True)
        check_response_format(self.format, "text.format")
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
                call = {"id": item.get("call_id") or item.get("id") or f"call_{i}", "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else _text(output, param)})
            else:
                raise InvalidRequest(f"input items of type {kind!r} are not supported", f"{param}.type")
        if not messages:
            raise InvalidRequest("input must not be empty", "input")
        return messages


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of text parts", f"{param}.content")
    out = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest("only text content parts (input_text) are supported", f"{param}.content[{j}]")
        out.append(part["text"])
    return "".join(out)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    request = _parse(ResponsesRequest, body)
    request.check()
    return request
