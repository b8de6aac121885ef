"""Long-context conversations of a fixed shape: each with its own system prompt of N tokens,
T turns of M-token user messages, fixed-length answers. Every turn after the first re-sends
a long prefix the server has seen, so it measures KV kept (or rebuilt) across turns."""
from __future__ import annotations

from dataclasses import dataclass

from loadtest.multiturn.dialog import Dialog, TurnSpec
from loadtest.workloads.synthetic_text import SyntheticText


@dataclass
class SyntheticShape:
    conversations: int = 16
    system_len: int = 5900  # tokens of each conversation's own system prompt
    turns: int = 4
    user_len: int = 64  # tokens of each user message
    output_len: int = 48


def synthetic_dialogs(shape: SyntheticShape, text: SyntheticText) -> list[Dialog]:
    return [Dialog(i, [{"role": "system", "content": text.text(shape.system_len)}],
                   [TurnSpec(output_len=shape.output_len, user=text.text(shape.user_len)) for _ in range(shape.turns)])
            for i in range(shape.conversations)]
