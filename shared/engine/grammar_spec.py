"""What a constrained request asks for: the grammar as text (never compiled state), so it
travels with the request from the gateway to every worker that samples for it."""
from __future__ import annotations

from dataclasses import dataclass

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class GrammarError(ValueError):
    """The grammar cannot be compiled, or not within the server's limits; the message names
    the problem (an API 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    text: str = ""  # the JSON schema (json_schema), the pattern (regex) or the grammar (ebnf)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} grammar needs its text")
