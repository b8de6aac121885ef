"""Which tokenizer the load generator counts with, and how it counts.

The server's `usage` fields are the truth we report; the tokenizer builds prompts of
exact lengths and checks that the server's counts are what the prompt should cost.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@functools.lru_cache(maxsize=4)  # a sweep or the disagg comparison loads it once, not per run
def load_tokenizer(name_or_path: str | None) -> Any:
    """A HF tokenizer from a name or folder; None means Duet's default model."""
    from transformers import AutoTokenizer

    if name_or_path:
        return AutoTokenizer.from_pretrained(name_or_path)
    from shared.engine.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


@dataclass
class TokenCounter:
    tokenizer: Any

    def prompt_tokens(self, messages: list[dict] | None, prompt: str | None) -> int:
        """What the server should count as prompt tokens for a chat or a completion request."""
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 may hand back a BatchEncoding
                ids = ids["input_ids"]
            return len(ids)
        return len(self.tokenizer(prompt or "")["input_ids"])

    def text_tokens(self, text: str) -> int:
        """Tokens of a piece of generated text, no special tokens added."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
