"""Replay a JSONL trace, one object a line: `timestamp` (or `time`, `ts`), `input_length` (or
`input_len`, `prompt_len`), `output_length` (or `output_len`), optionally `hash_ids` as in
Mooncake's traces: the prompt is built of `block_size`-token blocks, one per id, so lines that
share ids share a prefix."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from loadtest.workloads.request_spec import RequestSpec
from loadtest.workloads.synthetic_text import SyntheticText

_TIME_KEYS = ("timestamp", "time", "ts")
_IN_KEYS = ("input_length", "input_len", "prompt_len")
_OUT_KEYS = ("output_length", "output_len")


@dataclass
class TraceLine:
    timestamp: float  # seconds, from the trace's own zero
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None


def _pick(obj: dict, keys: tuple[str, ...], lineno: int):
    for k in keys:
        if k in obj:
            return obj[k]
    raise ValueError(f"trace line {lineno}: needs one of {', '.join(keys)}")


def read_trace(path: str | pathlib.Path, time_unit: str = "s") -> list[TraceLine]:
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[time_unit]
    lines = []
    for lineno, raw in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not raw.strip():
            continue
        obj = json.loads(raw)
        lines.append(TraceLine(float(_pick(obj, _TIME_KEYS, lineno)) * scale, int(_pick(obj, _IN_KEYS, lineno)),
                               int(_pick(obj, _OUT_KEYS, lineno)), obj.get("hash_ids")))
    lines.sort(key=lambda t: t.timestamp)
    return lines


def trace_requests(lines: list[TraceLine], text: SyntheticText, speedup: float = 1.0,
                   block_size: int = 512) -> list[RequestSpec]:
    """Requests with arrival times relative to the first line, divided by `speedup`."""
    blocks: dict[int, str] = {}
    return [RequestSpec(user_text=_prompt_from_blocks(line, text, blocks, block_size) if line.hash_ids
                        else text.text(line.input_len), output_len=max(1, line.output_len),
                        arrival_at=(line.timestamp - lines[0].timestamp) / speedup, target_input_len=line.input_len)
            for line in lines]


def _prompt_from_blocks(line: TraceLine, text: SyntheticText, blocks: dict[int, str], block_size: int) -> str:
    # The last block of a line is partial; it is cut to length here, not cached.
    parts, remaining = [], line.input_len
    for hid in line.hash_ids or []:
        if remaining <= 0:
            break
        if remaining >= block_size:
            if hid not in blocks:
                blocks[hid] = text.text(block_size)
            parts.append(blocks[hid])
            remaining -= block_size
        else:
            parts.append(text.text(remaining))
            remaining = 0
    if remaining > 0:
        parts.append(text.text(remaining))
    return "".join(parts)
