"""Prompt token ids from a request: the model's chat template, or plain text / token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.openai_protocol.errors import InvalidRequest


@dataclass
class PromptBuilder:
    tokenizer: Any  # a Hugging Face tokenizer (AutoTokenizer)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "PromptBuilder":
        from transformers import AutoTokenizer  # heavy import, only when a gateway starts

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def chat_prompt_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template: use /v1/completions", "messages")
        kwargs = dict(template_kwargs or {})
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        for reserved in ("tokenize", "conversation", "return_dict", "return_tensors", "tools"):
            kwargs.pop(reserved, None)
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja raises TemplateError (e.g. "roles must alternate")
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None
        # The template already contains BOS and other special tokens as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_prompt_ids(self, text: str) -> list[int]:
        # Plain completions get the tokenizer's usual specials (BOS for Llama), as vLLM does.
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        limit = self.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < limit:
                raise InvalidRequest(f"token id {token_id} is out of the vocabulary (size {limit})", param)
        return list(token_ids)
