"""What the engine reports back, per step and per finished request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutput:
    """New tokens of one request from one engine step."""
    rid: str
    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | moved (Engine.hand_over) | error
    stop_reason: str | int | None = None
    prefill_done: bool = False  # prefill-only request produced its first token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    text: str | None = None  # output text so far, only when stop strings are in use
    index: int = 0  # which sequence of an n > 1 request
    # True when every sequence of the request has finished (== finished when n == 1)
    request_finished: bool = False
    # with the first token of sequence 0 when asked (params.prompt_logprobs): per prompt
    # position, None for the first, else (logprob, [(token id, logprob), ...] best first)
    prompt_logprobs: list | None = None
    # on a sequence's last output when it speculated: its speculative/stats.SpecStats
    spec: object = None


@dataclass
class RequestOutput:
    """A whole finished request (offline API)."""
    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0

    def __getitem__(self, key):  # results readable as keys too
        return getattr(self, key)
