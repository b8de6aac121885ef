"""OpenAI response objects (chat.completion, chat.completion.chunk, text_completion) from deltas.

Each formatter knows one endpoint's shapes; the HTTP layer drives it with the deltas of
a Generation (or of several: a list of prompts), whose `index` is the choice's. Objects
are plain dicts, checked in the tests against OpenAI's schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.backends.interface import TokenLogprob
from services.gateway.openai_api.generation import GenerationStats, OutputDelta
from services.gateway.openai_api.token_strings import TokenStrings
from services.gateway.openai_api.tool_call_parsing import ToolStream, make_parser


def usage_object(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.total_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answers carry tool calls: a parser kind (tool_calls.py) and,
    for a named tool_choice, the function."""

    parser: str  # hermes | llama3_json | required | named
    name: str | None = None

    def new_stream(self) -> ToolStream:
        return ToolStream(make_parser(self.parser, self.name), named=self.name if self.parser == "named" else None)


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


@dataclass
class EchoPrompt:
    """One prompt of a completions request with echo: its text and token ids; its
    logprobs (tokens 1..) arrive with the generation (GenerationStats.prompt_logprobs)."""

    text: str
    token_ids: list[int]
    stats: GenerationStats | None = None


@dataclass
class CompletionFormatter:
    request_id: str
    model: str
    created: int
    token_strings: TokenStrings
    logprobs: int | None = None  # None: off; k: the sampled token plus k alternatives
    include_usage: bool = False
    n: int = 1  # choices per prompt: choice index = prompt index * n + sequence
    echo: list[EchoPrompt] | None = None  # one per prompt, when the prompt is echoed
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone
    done_marker: bool = True
    named_events: bool = False
    _offsets: dict[int, int] = field(default_factory=dict, init=False)  # characters emitted per choice

    def _object(self, choices: list[dict]) -> dict:
        # Unlike chat chunks, the completion schema has no nullable usage: omit it until the end.
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def opening_chunks(self) -> list[dict]:
        return []

    def chunks_for(self, delta: OutputDelta) -> list[dict]:
        chunks = []
        if self.echo is not None and delta.index not in self._offsets:
            chunks.append(self._object([self._echo_choice(delta.index, finish=None)]))
        if self.echo_only:
            delta = OutputDelta("", [], [], delta.finish_reason, delta.index)
        chunk = self.delta_chunk(delta)
        return chunks + ([] if chunk is None else [chunk])

    def _echo_choice(self, index: int, finish: str | None) -> dict:
        prompt = self.echo[index // self.n]
        return {"index": index, "text": prompt.text, "logprobs": self._prompt_logprobs(index, prompt),
                "finish_reason": finish}

    def delta_chunk(self, delta: OutputDelta) -> dict | None:
        has_logprobs = self.logprobs is not None and delta.logprobs
        if not delta.text and not has_logprobs and delta.finish_reason is None:
            return None
        choice = {"index": delta.index, "text": delta.text,
                  "logprobs": self._logprobs(delta.index, delta.logprobs, delta.text),
                  "finish_reason": delta.finish_reason}
        return self._object([choice])

    def usage_chunk(self, stats: GenerationStats) -> dict:
        obj = self._object([])
        obj["usage"] = self._usage(stats)
        return obj

    def closing_chunks(self, stats: GenerationStats) -> list[dict]:
        return [self.usage_chunk(stats)] if self.include_usage else []

    def _usage(self, stats: GenerationStats) -> dict:
        usage = usage_object(stats)
        if self.echo_only:  # the token made to get there is not part of the answer
            usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
        return usage

    def response(self, deltas: list[OutputDelta], stats: GenerationStats) -> dict:
        choices = []
        indices = sorted({d.index for d in deltas} | set(stats.finish_reasons))
        for index in indices:
            mine = [d for d in deltas if d.index == index]
            text, logprobs = "", None
            if self.logprobs is not None:
                logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if self.echo is not None:
                echoed = self._echo_choice(index, None)
                text = echoed["text"]
                if logprobs is not None:
                    for key in logprobs:
                        logprobs[key].extend(echoed["logprobs"][key])
            for delta in ([] if self.echo_only else mine):
                text += delta.text
                if logprobs is not None:
                    part = self._logprobs(index, delta.logprobs, delta.text)
                    for key in logprobs:
                        logprobs[key].extend(part[key])
            choices.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": stats.finish_reasons.get(index, stats.finish_reason)})
        obj = self._object(choices)
        obj["usage"] = self._usage(stats)
        return obj

    def _prompt_logprobs(self, index: int, prompt: EchoPrompt) -> dict | None:
        """The echoed prompt's logprobs: its first token has none (null), as OpenAI answers."""
        if self.logprobs is None:
            self._offsets[index] = self._offsets.get(index, 0) + len(prompt.text)
            return None
        by_pos = (prompt.stats.prompt_logprobs or []) if prompt.stats is not None else []
        entries: list[TokenLogprob | None] = [None] + list(by_pos)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for pos, token_id in enumerate(prompt.token_ids):
            token_text, _ = self.token_strings.get(token_id)
            lp = entries[pos] if pos < len(entries) else None
            out["tokens"].append(token_text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self._alternatives(lp))
            out["text_offset"].append(offset)
            offset += len(token_text)
        self._offsets[index] = self._offsets.get(index, 0) + len(prompt.text)
        return out

    def _alternatives(self, lp: TokenLogprob) -> dict:
        alternatives = {}
        for token_id, logprob in lp.top_logprobs[: self.logprobs]:
            alternatives.setdefault(self.token_strings.get(token_id)[0], logprob)
        return alternatives

    def _logprobs(self, index: int, logprobs: list[TokenLogprob], text: str) -> dict | None:
        """Legacy completions logprobs for one delta; text_offset counts emitted characters
        (tokens within one delta are placed by their own text lengths)."""
        if self.logprobs is None:
            self._offsets[index] = self._offsets.get(index, 0) + len(text)
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for lp in logprobs:
            token_text, _ = self.token_strings.get(lp.token_id)
            out["tokens"].append(token_text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(self._alternatives(lp))
            out["text_offset"].append(offset)
            offset += len(token_text)
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return out
