"""The KV a request can fill, in pages, and whether a pool can ever hold it.

n sequences share the prompt's full pages (one prefill; the radix tree holds them once);
each sequence copies the prompt's last, partly filled page and grows its own pages from
there up to max_tokens. So a request needs

    full + n * (pages_for(prompt + max_tokens) - full),   full = prompt // page_size

pages at most. A worker whose pool (its capacity, free or not) is smaller can never serve
it: that is a 400, not a "retry later". Everything here is arithmetic; callers pass the
numbers they know (the engine its pool, the gateway the largest live worker's)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.openai_protocol.errors import InvalidRequest

KV_CAPACITY_EXCEEDED = "kv_capacity_exceeded"


def pages_for(tokens: int, page_size: int) -> int:
    return -(-max(0, tokens) // page_size)


@dataclass(frozen=True)
class KVDemand:
    prompt_tokens: int
    max_tokens: int
    n: int
    page_size: int

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.n < 1 or self.prompt_tokens < 0 or self.max_tokens < 0:
            raise ValueError(f"a KV demand needs page_size >= 1, n >= 1 and counts >= 0, got {self}")

    @property
    def shared_pages(self) -> int:
        """The prompt's full pages: held once, whatever n."""
        return self.prompt_tokens // self.page_size

    @property
    def pages_per_sequence(self) -> int:
        """Pages one sequence owns: the prompt's last partial page (copied) and its growth."""
        return pages_for(self.prompt_tokens + self.max_tokens, self.page_size) - self.shared_pages

    @property
    def pages(self) -> int:
        return self.shared_pages + self.n * self.pages_per_sequence

    @property
    def tokens(self) -> int:
        """KV slots the request can fill: the prompt once, each sequence's completion."""
        return self.prompt_tokens + self.n * self.max_tokens


def kv_demand(prompt_tokens: int, max_tokens: int, n: int = 1, page_size: int = 1) -> KVDemand:
    return KVDemand(prompt_tokens, max_tokens, n, page_size)


def check_fits(demand: KVDemand, capacity_pages: int, holder: str = "this worker") -> None:
    """InvalidRequest (code kv_capacity_exceeded, param max_tokens) when `capacity_pages`
    can never hold the request, however long it waits."""
    if demand.pages <= capacity_pages:
        return
    more = " and n" if demand.n > 1 else ""
    raise InvalidRequest(
        f"request needs {demand.tokens} tokens of KV; {holder} holds {capacity_pages * demand.page_size} "
        f"({demand.pages} pages of {demand.page_size} tokens needed, {capacity_pages} in the pool). "
        f"Lower max_tokens{more} or shorten the prompt.", "max_tokens", KV_CAPACITY_EXCEEDED)
