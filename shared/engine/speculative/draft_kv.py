"""The draft model's own paged KV: a pool beside the target's (never registered for
transfer, never cached in a radix tree), its page allocator, and a per-request sequence
the engine's step planner can read (DraftSeq).

Keeping it apart from the target's pool keeps the target's layout (what the KV transfer
and the pairing compat hash describe) exactly as without speculation: a decode worker
that speculates pairs with prefill workers that do not."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv_pool import KVLayout, KVPool, PageAllocator
from ..sampling_params import SamplingParams

_NO_LOGPROBS = SamplingParams(max_tokens=None)


class TokenView:
    """A request's tokens followed by the draft's own (a list-like view, no copy)."""

    def __init__(self, base: list[int], tail: list[int] | None = None):
        self.base = base
        self.tail = tail if tail is not None else []

    def __len__(self) -> int:
        return len(self.base) + len(self.tail)

    def __getitem__(self, i):
        n = len(self.base)
        if isinstance(i, slice):
            start, stop, _ = i.indices(len(self))
            if stop <= n:
                return self.base[start:stop]
            return self.base[start:n] + self.tail[max(start - n, 0):stop - n]
        if i < 0:
            i += len(self)
        return self.base[i] if i < n else self.tail[i - n]


@dataclass(eq=False)
class DraftSeq:
    """One request as the draft model sees it (what step_plan.plan_batch reads)."""
    token_ids: TokenView
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose draft KV is valid
    params: SamplingParams = field(default_factory=lambda: _NO_LOGPROBS)
    num_prompt: int = 0
    # set by a proposal: the request's length when it drafted, and how far the draft's KV
    # then reached (positions up to tentative - 1 hold its own drafts)
    base: int = 0
    tentative: int = 0


class DraftKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, device):
        self.shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, page_size=page_size,
                          head_dim=head_dim, dtype=dtype)
        self.page_size = page_size
        self.device = device
        self.pool: KVPool | None = None
        self.allocator: PageAllocator | None = None

    @property
    def bytes_per_token(self) -> int:
        return KVLayout(num_pages=1, **self.shape).bytes_per_token

    def allocate_pool(self, num_pages: int) -> None:
        self.pool = KVPool(KVLayout(num_pages=num_pages, **self.shape), self.device)
        self.allocator = PageAllocator(num_pages)

    def grow(self, seq: DraftSeq, upto_tokens: int) -> bool:
        need = -(-upto_tokens // self.page_size) - len(seq.page_ids)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            return False
        seq.page_ids += self.allocator.allocate(need)
        return True

    def release(self, seq: DraftSeq) -> None:
        if seq.page_ids:
            self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.num_computed = 0

    @property
    def pages_in_use(self) -> int:
        return self.allocator.capacity - self.allocator.num_free if self.allocator else 0
