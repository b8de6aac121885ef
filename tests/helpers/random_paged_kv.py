"""Random paged KV caches for the kernel tests.

Builds a pool laid out as the engine's (shared/engine/kv_pool.py: page-major, head-major
pages) `[pages, kv_heads, layers, 2, page_size, head_dim]`
in which only the live tokens of one layer hold data: every other slot
(page 0, which padding page-table entries point to; spare pages; the tail of
each sequence's last page; the other layers) is NaN, so a kernel that reads
anything past seq_len, or through a wrong stride, produces NaN.
"""

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RandomPagedKV:
    pool: torch.Tensor  # [pages, kv_heads, layers, 2, page_size, head_dim]
    layer: int
    page_table: torch.Tensor  # int32 [B, P], padding entries 0
    seq_lens: torch.Tensor  # int32 [B]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool[:, :, self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, :, self.layer, 1]

    @property
    def page_size(self) -> int:
        return self.pool.shape[4]


def random_paged_kv(
    seq_lens: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    num_layers: int = 2,
    layer: int = 1,
    spare_pages: int = 2,
    extra_table_cols: int = 1,
    poison: bool = True,
) -> RandomPagedKV:
    """Pages are handed out in a random order (page 0 never holds data)."""
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    ids = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    width = max(pages_per_seq, default=0) + extra_table_cols
    page_table = torch.zeros((len(seq_lens), max(width, 1)), dtype=torch.int32)
    shape = (num_pages, num_kv_heads, num_layers, 2, page_size, head_dim)
    pool = torch.full(shape, float("nan") if poison else 0.0, dtype=torch.float32)
    live = torch.randn(shape, generator=generator)
    cursor = 0
    for b, n in enumerate(seq_lens):
        for j in range(pages_per_seq[b]):
            page = ids[cursor]
            cursor += 1
            page_table[b, j] = page
            used = min(page_size, n - j * page_size)
            pool[page, :, layer, :, :used] = live[page, :, layer, :, :used]
    if not poison:
        pool = live
    return RandomPagedKV(
        pool=pool.to(device=device, dtype=dtype),
        layer=layer,
        page_table=page_table.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
    )
