"""Shape checks and helpers for the paged KV cache views the kernels take.

A layer's cache is a view `[num_pages, num_kv_heads, page_size, head_dim]` of
the page-major pool; only the last dimension must be contiguous. A token's slot
is `page_id * page_size + offset_in_page`.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCacheShape:
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "PagedCacheShape":
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError(
                f"k_cache/v_cache must both be [num_pages, kv_heads, page_size, head_dim], "
                f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("the head_dim axis of the KV cache must be contiguous")
        return cls(*k_cache.shape)


def gather_dense_kv(cache: torch.Tensor, page_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] for one sequence: the reference's way to read KV."""
    page_size = cache.shape[2]
    pos = torch.arange(length, device=cache.device)
    pages = page_table_row.to(cache.device).long()[pos // page_size]
    return cache[pages, :, pos % page_size, :]


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
