"""Chat template settings: which `chat_template_kwargs` a request may set, and the budget of
one render (a helper process renders, chat_renderer.py). A request never supplies a template:
the model's own (the operator's) is the only one rendered."""
from __future__ import annotations

from dataclasses import dataclass

from shared.settings import parsers
from shared.settings.spec import setting

# Switches the common reasoning templates read (Qwen3, DeepSeek V3.1, gpt-oss).
DEFAULT_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")


@dataclass
class ChatTemplateConfig:
    kwargs_allowed: tuple[str, ...] | list[str] = setting(
        DEFAULT_KWARGS, flag="--chat-template-kwargs", env="DUET_CHAT_TEMPLATE_KWARGS", parse=parsers.words,
        help="chat_template_kwargs keys a request may set (plain values only; add_generation_prompt always)")
    timeout_s: float = setting(
        10.0, flag="--chat-template-timeout", env="DUET_CHAT_TEMPLATE_TIMEOUT",
        help="seconds one request's prompt may take to render and tokenize before it gets 400")
    processes: int = setting(
        2, flag="--chat-template-processes", env="DUET_CHAT_TEMPLATE_PROCESSES",
        help="helper processes that render chat templates (each holds a copy of the tokenizer)")

    def __post_init__(self) -> None:
        self.kwargs_allowed = tuple(self.kwargs_allowed)
        if self.timeout_s <= 0:
            raise ValueError(f"chat template timeout must be > 0, got {self.timeout_s}")
        if self.processes < 1:
            raise ValueError(f"chat template processes must be >= 1, got {self.processes}")
