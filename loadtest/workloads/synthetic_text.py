"""Prompt text of an exact token length. Random ids decoded to text usually re-tokenize to another
length (merges across the joins), so only tokens that are a space and letters and encode back to
themselves are drawn: word-splitting pre-tokenizers keep each whole, n drawn are n on the server."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from loadtest.tokenizer_source import TokenCounter

_WORD = re.compile(r"^ [A-Za-z]{2,12}$")


@dataclass
class SyntheticText:
    counter: TokenCounter
    rng: random.Random
    _pool: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        tok = self.counter.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or [])
        candidates = [i for i in range(len(tok)) if i not in special]
        texts = tok.batch_decode([[i] for i in candidates])
        words = [(i, t) for i, t in zip(candidates, texts) if _WORD.match(t)]
        encoded = tok([t for _, t in words], add_special_tokens=False)["input_ids"]
        self._pool = [i for (i, _), ids in zip(words, encoded) if ids == [i]]
        if len(self._pool) < 100:
            raise ValueError("tokenizer has too few plain word tokens to synthesize prompts")

    def text(self, n_tokens: int) -> str:
        return self.counter.decode(self.rng.choices(self._pool, k=n_tokens)) if n_tokens > 0 else ""
