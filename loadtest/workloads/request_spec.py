"""One request a workload asks for, before the API shape (chat or completions) is applied."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestSpec:
    user_text: str
    output_len: int
    system_text: str | None = None  # shared-prefix workloads put the long common prompt here
    arrival_at: float | None = None  # seconds from start, for trace replay
    target_input_len: int | None = None  # what the workload meant the prompt to cost, if it set one

    def chat_messages(self) -> list[dict]:
        msgs = [] if self.system_text is None else [{"role": "system", "content": self.system_text}]
        return msgs + [{"role": "user", "content": self.user_text}]

    def completion_prompt(self) -> str:
        return self.user_text if self.system_text is None else self.system_text + self.user_text
