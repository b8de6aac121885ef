"""Tensor-parallel context: which rank this process is and how to all-reduce.

Passed explicitly to the layers that need it (no module globals), so one process can
hold a TP=1 model for tests next to a TP=N worker."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadSlice:
    """Global KV heads [first, first + count) held by one tensor-parallel rank."""

    first: int
    count: int

    @property
    def stop(self) -> int:
        return self.first + self.count


def kv_head_slice(num_kv_heads: int, tp_size: int, rank: int) -> HeadSlice:
    """Rank `rank`'s KV heads at TP size `tp_size`. Heads split evenly when the TP size
    divides them; when TP exceeds them (and is a multiple), each head is replicated on
    tp_size / num_kv_heads consecutive ranks, as the query heads of its group are spread
    over those ranks (SGLang and vLLM do the same)."""
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return HeadSlice(rank * per, per)
    if tp_size % num_kv_heads == 0:
        return HeadSlice(rank // (tp_size // num_kv_heads), 1)
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor-parallel size {tp_size} must "
                     f"divide one another")


@dataclass
class TPContext:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup; None = default group
    # Optional fused/custom all-reduce (e.g. a one-shot P2P kernel on GPU); falls back to dist.
    custom_all_reduce: object | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None:
            out = self.custom_all_reduce(x)
            if out is not None:
                return out
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_across_ranks(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_ranks_agree(self, flag: bool, device: torch.device) -> bool:
        """True only if flag is True on every rank (for choices all ranks must share)."""
        return bool(self.min_across_ranks(int(flag), device))

    def kv_heads(self, num_kv_heads: int) -> "HeadSlice":
        """The KV heads this rank holds (kv_head_slice)."""
        return kv_head_slice(num_kv_heads, self.size, self.rank)

    def shard(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size {self.size}")
        return n // self.size
