"""Responses API objects (`response`, its output items, and the streaming events) from the
deltas of one Generation. Answers are read for tool calls like chat's (ToolMode), and
become `message` items (output_text) and `function_call` items. Events are numbered by
`sequence_number` and sent as named SSE events; the stream ends with response.completed
(or response.incomplete when max_output_tokens cut it), with no [DONE] marker."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_api.generation import GenerationStats, OutputDelta
from services.gateway.openai_api.tool_call_parsing import ToolMode, ToolStream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(stats: GenerationStats) -> dict:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.total_tokens}


@dataclass
class ResponsesFormatter:
    request_id: str
    model: str
    created: int
    echo: dict[str, Any]  # request fields a response repeats (instructions, tools, ...)
    tools: ToolMode | None = None
    done_marker: bool = False  # no "data: [DONE]" at the end of this API's streams
    named_events: bool = True
    _seq: int = field(default=0, init=False)
    _stream: ToolStream | None = field(default=None, init=False)
    _items: list[dict] = field(default_factory=list, init=False)
    _open: dict | None = field(default=None, init=False)  # the output item being written

    # --- the response object ------------------------------------------------------

    def _response(self, status: str, stats: GenerationStats | None, output: list[dict]) -> dict:
        incomplete = status == "incomplete"
        return {"id": self.request_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.model, "output": output, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": None, "store": False, "truncation": "disabled", "metadata": {},
                "text": {"format": {"type": "text"}}, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto",
                "tools": [], "instructions": None, "max_output_tokens": None,
                **self.echo, **({"usage": usage_object(stats)} if stats is not None else {})}

    def response(self, deltas: list[OutputDelta], stats: GenerationStats) -> dict:
        text = "".join(d.text for d in deltas)
        stream = self.tools.new_stream() if self.tools is not None else None
        output = []
        if stream is not None:
            stream.feed(text)
            stream.finish()
            text = stream.content
        if text or stream is None or not stream.called:
            output.append(self._message(text, "completed"))
        for call in (stream.calls if stream is not None else []):
            output.append(self._function_call(call.id, call.name, call.arguments, "completed"))
        return self._response(self._status(stats), stats, output)

    @staticmethod
    def _status(stats: GenerationStats) -> str:
        return "incomplete" if stats.finish_reason == "length" else "completed"

    @staticmethod
    def _message(text: str, status: str) -> dict:
        return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": _id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # --- streaming ---------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def opening_chunks(self) -> list[dict]:
        self._stream = self.tools.new_stream() if self.tools is not None else None
        start = self._response("in_progress", None, [])
        return [self._event("response.created", response=start),
                self._event("response.in_progress", response=start)]

    def chunks_for(self, delta: OutputDelta) -> list[dict]:
        if self._stream is None:
            pieces = [{"content": delta.text}] if delta.text else []
        else:
            pieces = self._stream.feed(delta.text)
            if delta.finish_reason is not None:
                pieces += self._stream.finish()
        events = []
        for piece in pieces:
            if "content" in piece:
                events += self._text(piece["content"])
            else:
                for call in piece["tool_calls"]:
                    if "id" in call:  # a new call starts
                        events += self._close()
                        events += self._open_item(self._function_call(
                            call["id"], call["function"]["name"], "", "in_progress"))
                    else:
                        self._open["arguments"] += call["function"]["arguments"]
                        events.append(self._event("response.function_call_arguments.delta",
                                                  item_id=self._open["id"], output_index=len(self._items),
                                                  delta=call["function"]["arguments"]))
        return events

    def _open_item(self, item: dict) -> list[dict]:
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self._items), item=dict(item))]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            item = self._message("", "in_progress")
            part = item["content"][0]
            item["content"] = []
            events += self._open_item(item)
            item["content"] = [part]
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._items), content_index=0, part=dict(part)))
        self._open["content"][0]["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=len(self._items), content_index=0, delta=text, logprobs=[]))
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        self._items.append(item)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def closing_chunks(self, stats: GenerationStats) -> list[dict]:
        events = [] if self._items or self._open else self._text("")  # always one output item
        events += self._close()
        status = self._status(stats)
        final = self._response(status, stats, self._items)
        return events + [self._event("response.completed" if status == "completed" else "response.incomplete",
                                     response=final)]
