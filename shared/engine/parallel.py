"""Tensor-parallel context: which rank this process is and how to all-reduce.

Passed explicitly to the layers that need it (no module globals), so one process can
hold a TP=1 model for tests next to a TP=N worker."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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

    def shard(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size {self.size}")
        return n // self.size
