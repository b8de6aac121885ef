"""Which tokenizer the load generator counts with, and how. The server's `usage` is the truth we
report; the tokenizer builds prompts of exact lengths and checks the server's counts."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any


@functools.lru_cache(maxsize=4)  # a sweep or the disagg comparison loads it once, not per run
def load_tokenizer(name_or_path: str | None) -> Any:
    """A HF tokenizer from a name or folder; None means Duet's default model."""
    from transformers import AutoTokenizer

    if name_or_path:
        return AutoTokenizer.from_pretrained(name_or_path)
    from shared.model_files.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


@dataclass
class TokenCounter:
    tokenizer: Any

    def prompt_tokens(self, messages: list[dict] | None, prompt: str | None, tools: list[dict] | None = None) -> int:
        """What the server should count as prompt tokens for a chat or a completion request.
        With tools, a template that ignores them gets their JSON's tokens added: servers then
        put the definitions into the system prompt (Duet does), so this is an estimate."""
        if messages is not None:
            n = self._chat_tokens(messages, tools)
            if tools and not self.template_renders_tools:
                n += self.text_tokens("\n".join(json.dumps(t) for t in tools))
            return n
        return len(self.tokenizer(prompt or "")["input_ids"])

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "probe_tool_xyz", "parameters": {"type": "object"}}}
        return self._chat_tokens(probe, [tool]) != self._chat_tokens(probe, None)

    def _chat_tokens(self, messages: list[dict], tools: list[dict] | None) -> int:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may hand back a BatchEncoding
            ids = ids["input_ids"]
        return len(ids)

    def text_tokens(self, text: str) -> int:
        """Tokens of a piece of generated text, no special tokens added."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
