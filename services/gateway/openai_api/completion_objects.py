"""Legacy Completions objects (text_completion, streamed or whole) from deltas: choices
numbered prompt index * n + sequence, the echoed prompt with its logprobs, and the legacy
logprobs shape (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.backends.interface import TokenLogprob
from services.gateway.openai_api.chat_objects import usage_object
from services.gateway.openai_api.generation import GenerationStats, OutputDelta
from services.gateway.openai_api.token_strings import TokenStrings


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
