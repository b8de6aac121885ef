"""What one request's grammar may cost: its size, its largest repetition count, and the
time a compile may take (in a helper process, grammar_guard.py). The gateway and the workers
read the same settings, so a schema past them is a 400 at the gateway and an INVALID_ARGUMENT
at any worker. No heavy imports: `--help` and `duet env` read this file."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from shared.settings import parsers
from shared.settings.spec import setting

from .grammar_spec import GrammarError, GrammarSpec

_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass
class GrammarLimits:
    timeout_s: float = setting(
        5.0, flag="--grammar-timeout", env="DUET_GRAMMAR_TIMEOUT",
        help="seconds one grammar (JSON schema, regex) may take to compile, in a helper process; longer is a 400")
    max_bytes: int = setting(
        256 << 10, flag="--grammar-max-bytes", env="DUET_GRAMMAR_MAX_BYTES", parse=parsers.size,
        help="largest JSON schema or regex a request may constrain its output with")
    max_repeat: int = setting(
        1000, flag="--grammar-max-repeat", env="DUET_GRAMMAR_MAX_REPEAT",
        help="largest {m,n} repetition count in a regex or a schema's pattern")
    processes: int = setting(
        1, flag="--grammar-processes", env="DUET_GRAMMAR_PROCESSES",
        help="helper processes that compile grammars (each holds the tokenizer's vocabulary)")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_bytes <= 0 or self.max_repeat <= 0 or self.processes < 1:
            raise ValueError(f"grammar limits must be positive: {self}")


def too_slow(spec_kind: str, limits_s: float) -> str:
    return (f"compiling this {spec_kind.replace('_', ' ')} takes longer than this server allows ({limits_s:g}s); "
            f"smaller repetition counts, lengths or nesting compile faster")


def check_size(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """GrammarError if the spec is larger than the limits allow (no compile needed to tell)."""
    what = spec.kind.replace("_", " ")
    size = len(spec.text.encode())
    if size > limits.max_bytes:
        raise GrammarError(f"the {what} is {size} bytes; this server compiles at most {limits.max_bytes}")
    for pattern in _patterns(spec):
        count = largest_repeat(pattern)
        if count > limits.max_repeat:
            raise GrammarError(f"the {what} repeats a pattern element {count} times (`{{...{count}}}`); "
                               f"this server allows at most {limits.max_repeat}")


def largest_repeat(pattern: str) -> int:
    """The largest count of a {m}, {m,} or {m,n} quantifier in a regex (0 without any)."""
    best, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: its braces are literal
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        m = _QUANTIFIER.match(pattern, i) if c == "{" else None
        if m is not None:
            try:
                best = max(best, int(m.group(2) or m.group(1)))
            except ValueError:  # more digits than int() takes
                return 1 << 62
            i = m.end()
            continue
        i += 1
    return best


def _patterns(spec: GrammarSpec) -> list[str]:
    if spec.kind == "regex":
        return [spec.text]
    if spec.kind != "json_schema":
        return []
    try:
        schema = json.loads(spec.text)
    except ValueError:
        return []  # the compile names the problem
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
