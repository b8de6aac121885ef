"""N-gram (prompt lookup) drafts: the longest recent suffix of the request's own tokens
that occurred before proposes the tokens that followed it.

Edits of given text and tool outputs echoed back repeat long runs of the prompt; such a
run is found by its last few tokens and copied. Each request keeps an index from every
n-gram (min_n..max_n tokens) to where it last ended, grown as tokens arrive (O(1) a token
for each n), so a lookup never scans the history. The latest earlier occurrence wins:
recent text is the likeliest to be repeated next. A proposal that runs past the end of
the known tokens continues from the proposal itself, so a periodic run drafts K tokens."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    min_n: int
    max_n: int
    # n -> {the n tokens ending (exclusive) at e: e}, for every e up to `upto`
    ends: dict[int, dict[tuple, int]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at positions <= upto are indexed

    def _index_until(self, tokens: list[int], end: int) -> None:
        for n in range(self.min_n, self.max_n + 1):
            table = self.ends.setdefault(n, {})
            for e in range(max(self.upto + 1, n), end + 1):
                table[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the suffix of `tokens`."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        self._index_until(tokens, length - 1)  # every n-gram that ends before the suffix does
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            e = self.ends.get(n, {}).get(tuple(tokens[length - n:]))
            if e is None:
                continue
            out: list[int] = []
            for i in range(k):
                j = e + i
                out.append(tokens[j] if j < length else out[j - length])
            return out
        return []


class NgramProposer:
    name = "ngram"
    deterministic = True  # a draft is a point mass: verification samples the target alone

    def __init__(self, min_n: int, max_n: int):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"n-gram window must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.fill_when_empty = False  # warm-up: propose the last token when nothing matches

    def propose(self, reqs, ks: list[int]) -> list:
        from .state import Draft
        out = []
        for req, k in zip(reqs, ks):
            st = req.spec
            if st.ngram is None:
                st.ngram = NgramIndex(self.min_n, self.max_n)
            toks = st.ngram.propose(req.token_ids, k)
            if not toks and self.fill_when_empty:
                toks = [req.token_ids[-1]] * k
            out.append(Draft(toks))
        return out

    def release(self, req) -> None:
        pass
