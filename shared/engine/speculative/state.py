"""What speculation keeps per request, and what a proposer hands back."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stats import SpecStats


@dataclass
class Draft:
    """Draft tokens for one request. probs: the distribution each token was drawn from
    ([len(tokens), vocab] on the device, target vocabulary) when the proposer sampled it;
    None for a point mass (n-gram lookups, greedy model drafts)."""
    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class SpecState:
    ngram: object = None  # ngram.NgramIndex
    draft: object = None  # a model proposer's per-request state (its KV pages, ...)
    # step aside: recent accepted / drafted (exponential average) and steps left to sit out
    acceptance: float = 1.0
    cooldown: int = 0
    method: str = ""
    stats: SpecStats = field(default=None)  # this request's, for its span

    def __post_init__(self):
        if self.stats is None:
            self.stats = SpecStats(self.method)
