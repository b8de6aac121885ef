"""Structured outputs under speculation: each draft token is checked against the request's
grammar before it is verified, and each verify row gets the mask of the grammar state the
tokens before it lead to. The matcher is advanced through the draft to fill those masks and
rolled back; the engine then advances it by the tokens actually accepted (Engine._append),
exactly as without speculation."""
from __future__ import annotations

from ..logit_constraints import Constraints


def truncate_to_grammar(grammar, tokens: list[int]) -> list[int]:
    """The longest prefix of `tokens` the grammar accepts, ending at a token that
    terminates it (nothing can follow one)."""
    m = grammar.matcher
    n = 0
    for t in tokens:
        if m.is_terminated() or not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return tokens[:n]


def draft_constraints(grammars, groups, pin: bool) -> Constraints | None:
    """groups: (grammar state or None, draft tokens) per verified request, in row order
    (len(tokens) + 1 rows each). The bitmask of every row whose grammar is live."""
    if grammars is None or all(g is None for g, _ in groups):
        return None
    total = sum(len(toks) + 1 for _, toks in groups)
    bitmask = grammars.alloc_bitmask(total, pin)
    live, row0 = [], 0
    for state, toks in groups:
        if state is not None:
            m = state.matcher
            advanced = 0
            for j in range(len(toks) + 1):
                if m.is_terminated():
                    break  # the request ends at the token before: later rows are never used
                m.fill_next_token_bitmask(bitmask, row0 + j)
                live.append(row0 + j)
                if j < len(toks):
                    if not m.accept_token(toks[j]):  # truncate_to_grammar ran first: cannot happen
                        raise AssertionError("draft token outside the grammar reached verification")
                    advanced += 1
            if advanced:
                m.rollback(advanced)
        row0 += len(toks) + 1
    return Constraints(bitmask, live) if live else None
