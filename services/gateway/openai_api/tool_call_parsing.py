"""Tool calls out of a model's text, as OpenAI chat deltas (streaming) or a whole message.

Parsers, one per output format (`--tool-call-parser`, as vLLM names them):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen 2.5/3, Hermes,
               and Duet's fallback prompt for templates without tools)
  llama3_json  {"name": ..., "parameters": {...}} as the whole answer, several joined by ";"
               (Llama 3.1/3.2; the <|python_tag|> special token is already stripped)
and two for grammar-forced output (tool_choice "required" or a named function), whose
text is plain JSON: a list of {"name", "parameters"} (vLLM's shape), or the named
function's arguments.

Each parser turns text pieces into events: ("content", text) or ("call", ToolCall), or
("arguments", text) for a named function streamed as it is written. Text that might
start a call is held back until it is known; a call that never parses stays content.
A ToolStream turns one choice's events into chat deltas; a ToolMode (chosen per request
from tool_choice and the template) says which parser a new ToolStream gets."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def as_message_entry(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_json(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return ToolCall(obj["name"], text)
    return ToolCall(obj["name"], "{}")


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        events = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.START)
                if at == -1:
                    keep = _partial_suffix(self.buffer, self.START)
                    emit = self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(emit):]
                    if emit:
                        events.append(("content", emit))
                    return events
                if at > 0:
                    events.append(("content", self.buffer[:at]))
                self.buffer = self.buffer[at + len(self.START):]
                self.inside = True
            end = self.buffer.find(self.END)
            if end == -1:
                return events
            block = self.buffer[:end]
            self.buffer = self.buffer[end + len(self.END):]
            self.inside = False
            events.append(self._block(block))

    def finish(self) -> list[tuple]:
        if not self.buffer and not self.inside:
            return []
        text, self.buffer = self.buffer, ""
        if self.inside:  # ended (EOS) before </tool_call>: a call if its JSON is whole
            self.inside = False
            return [self._block(text)]
        return [("content", text)]

    def _block(self, block: str) -> tuple:
        try:
            call = _call_from_json(json.loads(block))
        except ValueError:
            call = None
        return ("call", call) if call is not None else ("content", self.START + block + self.END)


class Llama3JsonParser:
    """The answer is either plain content or, from its first character, JSON tool calls."""

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None until the first non-space character decides

    def feed(self, text: str) -> list[tuple]:
        if self.mode == "content":
            return [("content", text)] if text else []
        self.buffer += text
        stripped = self.buffer.lstrip()
        if not stripped:
            return []
        self.mode = "json" if stripped[0] == "{" else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return [("content", out)]
        return []

    def finish(self) -> list[tuple]:
        text, self.buffer = self.buffer, ""
        if self.mode != "json":
            return [("content", text)] if text else []
        calls = []
        for part in _split_top_level(text.strip(), ";"):
            try:
                call = _call_from_json(json.loads(part), ("parameters", "arguments"))
            except ValueError:
                call = None
            if call is None:
                return [("content", text)]
            calls.append(("call", call))
        return calls


class RequiredParser:
    """tool_choice "required": the grammar forced a JSON list of {"name", "parameters"}."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        return []

    def finish(self) -> list[tuple]:
        try:
            items = json.loads(self.buffer)
        except ValueError:  # cut short (max_tokens): hand back the text
            return [("content", self.buffer)] if self.buffer else []
        return [("call", c) for c in (_call_from_json(i, ("parameters", "arguments")) for i in items) if c]


class NamedParser:
    """tool_choice naming a function: the grammar forced its arguments; stream them as written."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> list[tuple]:
        return [("arguments", text)] if text else []

    def finish(self) -> list[tuple]:
        return []


def make_parser(kind: str, name: str | None = None):
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "required": RequiredParser}.get(
        kind, lambda: NamedParser(name))()


@dataclass
class ToolStream:
    """One choice's tool-call state: events in, OpenAI chat delta dicts out."""

    parser: object
    named: str | None = None  # the named function (tool_choice), streamed as arguments
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _named_call: ToolCall | None = None

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text) if text else [])

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "content":
                self.content += value
                out.append({"content": value})
            elif kind == "call":
                index = len(self.calls)
                self.calls.append(value)
                out.append({"tool_calls": [{"index": index, "id": value.id, "type": "function",
                                            "function": {"name": value.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})
            else:  # named function arguments, as they come
                if self._named_call is None:
                    self._named_call = ToolCall(self.named, "")
                    self.calls.append(self._named_call)
                    out.append({"tool_calls": [{"index": 0, "id": self._named_call.id, "type": "function",
                                                "function": {"name": self.named, "arguments": ""}}]})
                self._named_call.arguments += value
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
        return out


@dataclass(frozen=True)
class ToolMode:
    """How a request's answers carry tool calls (chat and the Responses API): a parser
    kind (make_parser) and, for a named tool_choice, the function."""

    parser: str  # hermes | llama3_json | required | named
    name: str | None = None

    def new_stream(self) -> ToolStream:
        return ToolStream(make_parser(self.parser, self.name), named=self.name if self.parser == "named" else None)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split at `sep` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]
