"""One request's token stream turned into text deltas: detokenize, cut at stop strings, time it.

Both endpoints (chat and completions) consume `Generation.deltas()`; they differ only
in how a delta is written out. A request with n > 1 sequences yields deltas of every
sequence (`index`), each detokenized and cut at stop strings on its own.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from services.gateway.backends.interface import (
    FINISH_STOP,
    BackendUnavailable,
    GenerationBackend,
    GenerationRequest,
    TokenLogprob,
)
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.stop_strings import StopStringMatcher
from shared.detokenizer import IncrementalDetokenizer
from shared.telemetry.token_latency import TokenLatency


@dataclass
class OutputDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    index: int = 0  # which sequence (n > 1)


@dataclass
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # of the last sequence to finish
    finish_reasons: dict[int, str] = field(default_factory=dict)  # by sequence index
    prompt_logprobs: list[TokenLogprob] | None = None  # echo: prompt tokens 1..
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Generation:
    backend: GenerationBackend
    request: GenerationRequest
    tokenizer: Any
    metrics: GatewayMetrics
    endpoint: str
    arrived_at: float = field(default_factory=time.monotonic)  # monotonic clock

    @property
    def labels(self) -> tuple[str, str, str]:
        """The gateway series' labels: endpoint, model, LoRA adapter ("" for the base model)."""
        return self.endpoint, self.request.model, self.request.cache_scope.adapter

    def __post_init__(self) -> None:
        self.stats = GenerationStats(prompt_tokens=len(self.request.prompt_token_ids))
        self.latency = TokenLatency(self.metrics.latency(*self.labels), self.arrived_at)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Text deltas until the request finishes; the last one has finish_reason.

        Leaving early (the consumer stops iterating, or its task is cancelled) closes the
        backend's generator, which aborts the work there."""
        n = self.request.sampling.n
        detoks = [IncrementalDetokenizer(self.tokenizer, self.request.prompt_token_ids) for _ in range(n)]
        stops = [StopStringMatcher(list(self.request.sampling.stop)) for _ in range(n)]
        async with aclosing(self.backend.generate(self.request)) as events:
            async for event in events:
                i = event.index
                if event.prompt_logprobs is not None:
                    self.stats.prompt_logprobs = event.prompt_logprobs
                if i in self.stats.finish_reasons:
                    continue  # this sequence already stopped at a stop string; the engine ends it too
                self._observe(event.token_ids, event.cached_tokens)
                text = detoks[i].push(event.token_ids)
                if event.finish_reason is not None:
                    text += detoks[i].flush()
                text = stops[i].feed(text)
                logprobs = list(event.logprobs or [])
                if stops[i].stopped:
                    yield self._finish(OutputDelta(text, list(event.token_ids), logprobs, index=i), FINISH_STOP)
                    if len(self.stats.finish_reasons) == n:
                        # The engine may run a few tokens past the stop string before it sees
                        # it; closing the generator (leaving the `async with`) aborts them.
                        return
                    continue
                if event.finish_reason is not None:
                    text += stops[i].flush()
                    yield self._finish(OutputDelta(text, list(event.token_ids), logprobs, index=i), event.finish_reason)
                    if len(self.stats.finish_reasons) == n:
                        return
                    continue
                yield OutputDelta(text, list(event.token_ids), logprobs, index=i)
        raise BackendUnavailable("the backend's token stream ended before the request finished")

    def _finish(self, delta: OutputDelta, reason: str) -> OutputDelta:
        delta.finish_reason = reason
        self.stats.finish_reason = reason
        self.stats.finish_reasons[delta.index] = reason
        if len(self.stats.finish_reasons) == self.request.sampling.n:
            self.latency.finish()
        return delta

    def _observe(self, token_ids: list[int], cached_tokens: int | None) -> None:
        count = len(token_ids)
        if cached_tokens is not None:
            self.stats.cached_tokens = cached_tokens
        if count == 0:
            return
        self.latency.observe(count)  # TTFT, then the gap to each later token (shared evenly within an event)
        self.stats.first_token_at, self.stats.last_token_at = self.latency.first_at, self.latency.last_at
        self.stats.completion_tokens += count
        self.metrics.generation_tokens.labels(*self.labels).inc(count)
