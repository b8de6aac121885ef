"""ShareGPT conversations replayed turn by turn.

Each human turn is sent after the history so far; the dataset's gpt turn only sets that
turn's output length (its token count, or a fixed --output-len): the history carries the
model's own answers."""
from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.multiturn.dialog import Dialog, TurnSpec
from loadtest.tokenizer_source import TokenCounter

_USER = {"human", "user"}
_ASSISTANT = {"gpt", "chatgpt", "bing", "bard", "assistant"}


@dataclass
class Exchange:
    user: str
    reply: str


@dataclass
class ShareGPTDialog:
    system: str | None
    exchanges: list[Exchange]


def normalize(turns: list[dict]) -> ShareGPTDialog:
    """user/assistant exchanges from a ShareGPT `conversations` list. Leading replies (a
    third of the file opens with gpt) are skipped, a leading system turn is kept, and
    consecutive turns of one side are joined; it stops at an empty user turn."""
    system, merged = None, []
    for t in turns:
        who, text = t.get("from"), (t.get("value") or "")
        role = "user" if who in _USER else "assistant" if who in _ASSISTANT else "system" if who == "system" else None
        if role == "system":
            if not merged and system is None:
                system = text
            continue
        if role is None or (not merged and role == "assistant"):
            continue
        if merged and merged[-1][0] == role:
            merged[-1][1] += "\n\n" + text
        else:
            merged.append([role, text])
    exchanges = []
    for (r1, asked), (r2, answered) in zip(merged[::2], merged[1::2]):
        if r1 != "user" or r2 != "assistant" or not asked.strip():
            break
        exchanges.append(Exchange(asked, answered))
    return ShareGPTDialog(system, exchanges)


@dataclass
class ShareGPTLimits:
    min_turns: int = 2  # conversations with fewer exchanges are skipped
    max_turns: int | None = None  # longer ones are cut here
    fixed_output_len: int | None = None
    max_output_len: int | None = None  # cap on the reply-derived output length
    max_context_tokens: int | None = None  # skip conversations whose first turn would not fit


def sample_sharegpt_dialogs(items: list[dict], num: int, counter: TokenCounter, rng: random.Random,
                            limits: ShareGPTLimits) -> list[Dialog]:
    """`num` conversations in seeded random order, tokenizing only as many as it takes."""
    order = list(range(len(items)))
    rng.shuffle(order)
    out: list[Dialog] = []
    for idx in order:
        if len(out) >= num:
            break
        d = normalize(items[idx].get("conversations") or [])
        exchanges = d.exchanges[:limits.max_turns] if limits.max_turns else d.exchanges
        if len(exchanges) < max(1, limits.min_turns):
            continue
        opening = [{"role": "system", "content": d.system}] if d.system else []
        turns = [TurnSpec(output_len=_output_len(e.reply, counter, limits), user=e.user) for e in exchanges]
        if limits.max_context_tokens is not None:
            first = counter.prompt_tokens(opening + [{"role": "user", "content": exchanges[0].user}], None)
            if first + turns[0].output_len > limits.max_context_tokens:
                continue
        out.append(Dialog(len(out), opening, turns))
    if len(out) < num:
        raise SystemExit(f"only {len(out)} ShareGPT conversations have {limits.min_turns}+ turns and fit "
                         f"the context limit; {num} asked")
    return out


def _output_len(reply: str, counter: TokenCounter, limits: ShareGPTLimits) -> int:
    if limits.fixed_output_len is not None:
        return limits.fixed_output_len
    n = max(1, counter.text_tokens(reply))
    return min(n, limits.max_output_len) if limits.max_output_len else n
