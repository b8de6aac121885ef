"""Per-request sampling parameters, named as in the OpenAI API and vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field

from .grammar_spec import GrammarSpec

MAX_N = 128  # sequences one request may fork into


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: off; 0: chosen token only; N: also top-N
    skip_special_tokens: bool = True
    n: int = 1  # sequences sampled from one prompt; they share its KV pages (one prefill)
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit (OpenAI)
    grammar: GrammarSpec | None = None  # constrained decoding (JSON schema, regex, EBNF)
    prompt_logprobs: int | None = None  # None: off; N: logprob of each prompt token + top-N


    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a message fit for an API error on bad values."""
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0 or not (-100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {token}: {bias}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def child_seed(self, seed: int, index: int) -> int:
        """Sequence `index` of an n > 1 request draws with seed + index (as vLLM does)."""
        return (seed + index) & 0xFFFFFFFFFFFFFFFF

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
