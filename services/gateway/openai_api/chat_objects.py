"""Chat Completions objects (chat.completion, chat.completion.chunk) from deltas, and the
usage object that chat and legacy completions share.

Each formatter knows one endpoint's shapes (completion_objects.py: text_completion;
responses_objects.py: the Responses API); the endpoints drive it with the deltas of a
Generation, whose `index` is the choice's. Objects are plain dicts, checked in the tests
against OpenAI's schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.backends.interface import TokenLogprob
from services.gateway.openai_api.generation import GenerationStats, OutputDelta
from services.gateway.openai_api.token_strings import TokenStrings
from services.gateway.openai_api.tool_call_parsing import ToolMode, ToolStream


def usage_object(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.total_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


@dataclass
class ChatFormatter:
    request_id: str
    model: str
    created: int
    token_strings: TokenStrings
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False  # streaming only: usage: null on chunks, a final usage chunk
    n: int = 1
    tools: ToolMode | None = None
    done_marker: bool = True  # streams end with "data: [DONE]"
    named_events: bool = False
    _streams: dict[int, ToolStream] = field(default_factory=dict, init=False)

    # --- streaming ------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict]:
        return [self.role_chunk(i) for i in range(self.n)]

    def _stream(self, index: int) -> ToolStream | None:
        if self.tools is None:
            return None
        if index not in self._streams:
            self._streams[index] = self.tools.new_stream()
        return self._streams[index]

    def chunks_for(self, delta: OutputDelta) -> list[dict]:
        """What to stream for one delta: its content and tool-call pieces, then the finish
        chunk (if last). Logprobs ride on the delta's first chunk."""
        stream = self._stream(delta.index)
        if stream is None:
            pieces = [{"content": delta.text}] if delta.text else []
        else:
            pieces = stream.feed(delta.text)
            if delta.finish_reason is not None:
                pieces += stream.finish()
        logprobs = self._logprobs(delta.logprobs) if self.logprobs and delta.logprobs else None
        if logprobs is not None and not pieces:
            pieces = [{"content": ""}]
        chunks = [self._chunk([{"index": delta.index, "delta": piece, "logprobs": logprobs if k == 0 else None,
                                "finish_reason": None}]) for k, piece in enumerate(pieces)]
        if delta.finish_reason is not None:
            chunks.append(self.finish_chunk(self._reason(stream, delta.finish_reason), delta.index))
        return chunks

    def role_chunk(self, index: int = 0) -> dict:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def finish_chunk(self, reason: str, index: int = 0) -> dict:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self, stats: GenerationStats) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage_object(stats)
        return chunk

    def closing_chunks(self, stats: GenerationStats) -> list[dict]:
        return [self.usage_chunk(stats)] if self.include_usage else []

    @staticmethod
    def _reason(stream: ToolStream | None, reason: str) -> str:
        return "tool_calls" if stream is not None and stream.called and reason == "stop" else reason

    # --- whole response -------------------------------------------------------

    def response(self, deltas: list[OutputDelta], stats: GenerationStats) -> dict:
        choices = []
        for index in range(self.n):
            mine = [d for d in deltas if d.index == index]
            text = "".join(d.text for d in mine)
            message = {"role": "assistant", "content": text, "refusal": None}
            stream = self.tools.new_stream() if self.tools is not None else None
            if stream is not None:
                stream.feed(text)
                stream.finish()
                message["content"] = stream.content or None if stream.called else stream.content
                if stream.called:
                    message["tool_calls"] = [c.as_message_entry() for c in stream.calls]
            reason = stats.finish_reasons.get(index, stats.finish_reason)
            choices.append({"index": index, "message": message,
                            "logprobs": self._logprobs([lp for d in mine for lp in d.logprobs]),
                            "finish_reason": self._reason(stream, reason)})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_object(stats)}

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [self._token_logprob(lp) for lp in logprobs], "refusal": None}

    def _token_logprob(self, lp: TokenLogprob) -> dict:
        text, raw = self.token_strings.get(lp.token_id)
        top = []
        for token_id, logprob in lp.top_logprobs[: self.top_logprobs]:
            alt_text, alt_raw = self.token_strings.get(token_id)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}
