"""OpenAI response objects (chat.completion, chat.completion.chunk, text_completion) from deltas.

Each formatter knows one endpoint's shapes; the HTTP layer drives it with the deltas of
a Generation. Objects are plain dicts, checked in the tests against OpenAI's schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.backend import TokenLogprob
from services.gateway.generation import GenerationStats, OutputDelta
from services.gateway.token_strings import TokenStrings


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

    # --- streaming ------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict]:
        return [self.role_chunk()]

    def chunks_for(self, delta: OutputDelta) -> list[dict]:
        """What to stream for one delta: its text (if any), then the finish chunk (if last)."""
        chunks = []
        text_chunk = self.delta_chunk(delta)
        if text_chunk is not None:
            chunks.append(text_chunk)
        if delta.finish_reason is not None:
            chunks.append(self.finish_chunk(delta.finish_reason))
        return chunks

    def role_chunk(self) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta_chunk(self, delta: OutputDelta) -> dict | None:
        """The chunk carrying a delta's text (and logprobs), or None when there is nothing."""
        if not delta.text and not (self.logprobs and delta.logprobs):
            return None
        return self._chunk([{"index": 0, "delta": {"content": delta.text},
                             "logprobs": self._logprobs(delta.logprobs), "finish_reason": None}])

    def finish_chunk(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self, stats: GenerationStats) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage_object(stats)
        return chunk

    # --- whole response -------------------------------------------------------

    def response(self, deltas: list[OutputDelta], stats: GenerationStats) -> dict:
        logprobs = [lp for d in deltas for lp in d.logprobs]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "".join(d.text for d in deltas), "refusal": None},
                "logprobs": self._logprobs(logprobs),
                "finish_reason": stats.finish_reason,
            }],
            "usage": usage_object(stats),
        }

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
class CompletionFormatter:
    request_id: str
    model: str
    created: int
    token_strings: TokenStrings
    logprobs: int | None = None  # None: off; k: the sampled token plus k alternatives
    include_usage: bool = False
    _text_offset: int = field(default=0, init=False)  # characters emitted so far (for text_offset)

    def _object(self, choices: list[dict]) -> dict:
        # Unlike chat chunks, the completion schema has no nullable usage: omit it until the end.
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def opening_chunks(self) -> list[dict]:
        return []

    def chunks_for(self, delta: OutputDelta) -> list[dict]:
        chunk = self.delta_chunk(delta)
        return [] if chunk is None else [chunk]

    def delta_chunk(self, delta: OutputDelta) -> dict | None:
        has_logprobs = self.logprobs is not None and delta.logprobs
        if not delta.text and not has_logprobs and delta.finish_reason is None:
            return None
        choice = {"index": 0, "text": delta.text, "logprobs": self._logprobs(delta.logprobs, delta.text),
                  "finish_reason": delta.finish_reason}
        return self._object([choice])

    def usage_chunk(self, stats: GenerationStats) -> dict:
        obj = self._object([])
        obj["usage"] = usage_object(stats)
        return obj

    def response(self, deltas: list[OutputDelta], stats: GenerationStats) -> dict:
        logprobs = None
        if self.logprobs is not None:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for delta in deltas:
                part = self._logprobs(delta.logprobs, delta.text)
                for key in logprobs:
                    logprobs[key].extend(part[key])
        obj = self._object([{"index": 0, "text": "".join(d.text for d in deltas), "logprobs": logprobs,
                             "finish_reason": stats.finish_reason}])
        obj["usage"] = usage_object(stats)
        return obj

    def _logprobs(self, logprobs: list[TokenLogprob], text: str) -> dict | None:
        """Legacy completions logprobs for one delta; text_offset counts emitted characters
        (tokens within one delta are placed by their own text lengths)."""
        if self.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._text_offset
        for lp in logprobs:
            token_text, _ = self.token_strings.get(lp.token_id)
            out["tokens"].append(token_text)
            out["token_logprobs"].append(lp.logprob)
            alternatives = {}
            for token_id, logprob in lp.top_logprobs[: self.logprobs]:
                alternatives.setdefault(self.token_strings.get(token_id)[0], logprob)
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(offset)
            offset += len(token_text)
        self._text_offset += len(text)
        return out
