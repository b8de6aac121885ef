"""What one request did, as seen by the client: the raw material every metric comes from."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """Times are seconds on the client's monotonic clock, relative to the run's start."""

    index: int
    scheduled_at: float  # when the arrival process wanted it sent
    prompt_len: int  # tokenizer count of the prompt as the server will see it (chat template applied)
    max_tokens: int
    sent_at: float = 0.0
    first_token_at: float | None = None  # first chunk that carried output text
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk carrying text (or tokens, by logprobs)
    done_at: float | None = None
    ok: bool = False
    error_kind: str | None = None  # e.g. http_429, timeout, connect, stream_error
    error_detail: str | None = None
    http_status: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says
    output_chars: int = 0
    output_tokens_tokenizer: int | None = None  # re-count of the output text, for the usage check
    finish_reason: str | None = None
    output_text: str | None = None  # kept only when asked (--save-text)
    model: str | None = None  # the model or LoRA adapter it named, with --lora-mix
    response_id: str | None = None  # the id the server gave the completion (its chunks' "id"): its log's name for it

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def output_tokens(self) -> int:
        """Server's count when it gave one, else our tokenizer's, else one per chunk."""
        counts = (self.usage_completion_tokens, self.output_tokens_tokenizer, len(self.chunk_times))
        return next(n for n in counts if n is not None)

    @property
    def input_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (the decode speed a user feels)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text-carrying chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        d = asdict(self)
        d["ttft"], d["e2e"], d["tpot"] = self.ttft, self.e2e, self.tpot
        d["output_tokens"], d["input_tokens"] = self.output_tokens, self.input_tokens
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})
