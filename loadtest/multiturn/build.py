"""Pick and build the conversations a multi-turn run asked for."""
from __future__ import annotations

import random

from loadtest.multiturn.agentic_sessions import AgenticShape, agentic_dialogs
from loadtest.multiturn.config import DialogWorkload
from loadtest.multiturn.dialog import Dialog
from loadtest.multiturn.sharegpt_dialogs import ShareGPTLimits, sample_sharegpt_dialogs
from loadtest.multiturn.synthetic_dialogs import SyntheticShape, synthetic_dialogs
from loadtest.tokenizer_source import TokenCounter
from loadtest.workloads.sharegpt import read_items
from loadtest.workloads.synthetic_text import SyntheticText


def build_dialogs(w: DialogWorkload, counter: TokenCounter, max_context_tokens: int | None) -> list[Dialog]:
    """`w` resolved (defaults filled in)."""
    rng = random.Random(w.seed)
    if w.name == "sharegpt":
        limits = ShareGPTLimits(w.min_turns, w.max_turns, w.output_len, w.max_output_len, max_context_tokens)
        return sample_sharegpt_dialogs(list(read_items(w.dataset_path)), w.conversations, counter, rng, limits)
    text = SyntheticText(counter, random.Random(w.seed + 1))
    if w.name == "synthetic":
        shape = SyntheticShape(w.conversations, w.system_len, w.max_turns, w.user_len, w.output_len)
        return synthetic_dialogs(shape, text)
    if w.name == "agentic":
        shape = AgenticShape(w.conversations, w.system_len, w.num_tools, w.max_turns, w.user_len,
                             w.tool_output_len, w.output_len)
        return agentic_dialogs(shape, text, rng)
    raise SystemExit(f"unknown multi-turn workload {w.name!r}")
