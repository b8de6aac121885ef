"""Where a page-major KV pool lives, as a transfer peer needs to know it."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router reads pools from the registry and never imports torch
    import torch


@dataclass(frozen=True)
class PoolInfo:
    """Pool layout [num_pages, ...] with page i at [base_addr + i*page_bytes, +page_bytes).

    Inside a page (head-major, shared/engine/kv_pool.py): `num_heads` heads, each `blocks`
    blocks (K and V of every layer) of head_bytes = page_bytes / (blocks * num_heads)
    contiguous bytes, so a range of heads is one contiguous byte range of the page; this
    rank holds global KV heads [first_head, first_head + num_heads). Writers between ranks
    of different tensor-parallel sizes copy head ranges out of each page (head_plan.py)."""

    base_addr: int
    page_bytes: int
    num_pages: int
    mem_type: str = "DRAM"  # NIXL memory type: DRAM (host) or VRAM (GPU)
    device_id: int = 0
    blocks: int = 1
    num_heads: int = 1
    first_head: int = 0

    @property
    def head_bytes(self) -> int:
        return self.page_bytes // (self.blocks * self.num_heads)

    @classmethod
    def from_tensor(cls, pool: torch.Tensor, first_head: int = 0) -> "PoolInfo":
        """A 6-d pool is the engine's [pages, heads, layers, 2, page_size, head_dim]; any
        other shape is one block of one head per page."""
        if not pool.is_contiguous():
            raise ValueError("KV pool must be contiguous (page-major layout)")
        if pool.dim() < 1 or pool.shape[0] < 1:
            raise ValueError(f"KV pool needs a leading page dimension, got shape {tuple(pool.shape)}")
        page_bytes = pool[0].numel() * pool.element_size()
        is_cuda = pool.device.type == "cuda"
        heads, blocks = (pool.shape[1], pool.shape[2] * pool.shape[3]) if pool.dim() == 6 else (1, 1)
        return cls(base_addr=pool.data_ptr(), page_bytes=page_bytes, num_pages=int(pool.shape[0]),
                   mem_type="VRAM" if is_cuda else "DRAM",
                   device_id=(pool.device.index or 0) if is_cuda else 0,
                   blocks=int(blocks), num_heads=int(heads), first_head=first_head)

    @classmethod
    def from_record(cls, record) -> "PoolInfo":
        """From any object with these attributes (e.g. shared.registry.worker_info.RankKvPool)."""
        return cls(base_addr=int(record.base_addr), page_bytes=int(record.page_bytes),
                   num_pages=int(record.num_pages), mem_type=str(record.mem_type),
                   device_id=int(record.device_id), blocks=int(getattr(record, "blocks", 1)),
                   num_heads=int(getattr(record, "num_heads", 1)),
                   first_head=int(getattr(record, "first_head", 0)))

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    def as_dict(self) -> dict:
        return asdict(self)

    def check_pages(self, page_ids, side: str) -> None:
        for page in page_ids:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"{side} page id {page} outside pool of {self.num_pages} pages")
