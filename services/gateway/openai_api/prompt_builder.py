"""Prompt token ids from a request: the model's chat template, or plain text / token ids.

Text from the client (message content, names, tool calls and results, tools) is tokenized as
plain text even where it spells a control token (`<|im_end|>`): only the control tokens the
template itself writes are control tokens, so a client cannot forge a turn (transformers'
`sanitize_control_tokens`: such tokens in the inputs are marked before rendering and encoded
as text; ordinary content gets the same ids as before)."""

from __future__ import annotations

import inspect
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
        # template variables only: never one of apply_chat_template's own parameters
        kwargs = {k: v for k, v in kwargs.items() if k not in _apply_parameters(self.tokenizer)}
        try:
            # The template writes BOS and other special tokens itself (no add_special_tokens).
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, sanitize_control_tokens=True, **kwargs)
        except Exception as exc:  # jinja raises TemplateError (e.g. "roles must alternate")
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None
        return list(ids)

    def text_prompt_ids(self, text: str) -> list[int]:
        # Plain completions get the tokenizer's usual specials (BOS for Llama), as vLLM does.
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        limit = self.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < limit:
                raise InvalidRequest(f"token id {token_id} is out of the vocabulary (size {limit})", param)
        return list(token_ids)


def _apply_parameters(tokenizer) -> frozenset[str]:
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) | {"chat_template", "conversation"}
