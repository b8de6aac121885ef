"""Tools into the prompt, through the model's own chat template.

A template that knows tools (it reads `tools`: Qwen, Llama 3.1, Hermes...) gets them as
`tools=` to apply_chat_template, and the history as those templates expect (assistant
tool_calls with their arguments as objects, `tool` messages as they are), as vLLM does.
Which parser reads the answer follows from the template: `<tool_call>` in it means the
Hermes format, `<|python_tag|>`/ipython the Llama 3 JSON format.

A template that ignores tools (SmolLM2's) gets Hermes-style instructions in its system
message instead, the history rewritten into that format (tool calls as <tool_call> blocks,
tool results as <tool_response> user turns), and the Hermes parser."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to help with the user's request.\n\n"
    "The functions, as JSON schemas, are within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolTemplate:
    native: bool  # the chat template renders tools itself
    parser: str  # hermes | llama3_json: the format the answer's calls come in

    @classmethod
    def detect(cls, chat_template: str | None, parser: str = "auto") -> "ToolTemplate":
        template = chat_template or ""
        native = "tools" in template
        if parser == "auto":
            if "<|python_tag|>" in template or "ipython" in template:
                parser = "llama3_json"
            else:
                parser = "hermes"  # <tool_call> templates, and our fallback
        return cls(native, parser)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools= argument) for apply_chat_template."""
        if self.native:
            return [_native_message(m) for m in messages], (tools or None)
        return _fallback_messages(messages, tools), None


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = [_with_object_arguments(c) for c in calls]
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """Templates index tool_call.function.arguments as an object (HF's convention)."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    return {**call, "function": fn, **fn}  # some templates read name/arguments at the top


def _fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": _with_object_arguments(c)["function"]["arguments"]},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = (m.get("content") or "") + "".join(f"\n<tool_call>\n{b}\n</tool_call>" for b in blocks)
            out.append({"role": "assistant", "content": text.lstrip("\n")})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        text = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
