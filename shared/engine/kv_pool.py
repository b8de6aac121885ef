"""The paged KV cache: one tensor, page-major, so a request's pages move as few large blocks.

Layout: [num_pages, kv_heads, num_layers, 2, page_size, head_dim]. Page i is one contiguous
byte range holding K and V of every layer for page_size tokens, so a run of consecutive page
ids is one transfer descriptor. Inside a page the heads are outermost (head-major), so any
range of heads is one contiguous byte range too: a worker at another tensor-parallel size
writes its share of a page as one descriptor (shared/kv_transfer/head_plan.py), not one per
layer. The kernels see a layer through strided [num_pages, kv_heads, page_size, head_dim]
views, and each (page, head) [page_size, head_dim] tile is contiguous in either order. Page 0
is kept back as a padding page (page-table padding and CUDA-graph dummy rows write there),
never handed out."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

PADDING_PAGE = 0


@dataclass(frozen=True)
class KVLayout:
    num_pages: int
    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_pages, self.num_kv_heads, self.num_layers, 2, self.page_size, self.head_dim)

    @property
    def page_order(self) -> str:
        """Named in the pairing key (services/worker/kv_compat.py): pools that order a page's
        bytes differently must never exchange pages."""
        return "heads_first"

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.page_size * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, **kw) -> "KVLayout":
        probe = cls(num_pages=1, **kw)
        pages = budget_bytes // probe.bytes_per_page
        if pages < 2:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds fewer than 2 pages "
                             f"({probe.bytes_per_page} bytes each)")
        return cls(num_pages=int(pages), **kw)


class KVPool:
    def __init__(self, layout: KVLayout, device: torch.device, scales: list[tuple[float, float]] | None = None):
        """scales: an FP8 pool's (k_scale, v_scale) per layer (kernels/store_kv.py): pages hold
        k / k_scale and v / v_scale. A 16/32-bit pool holds K and V as they are (1.0)."""
        self.layout = layout
        self.device = device
        self.buffer = torch.zeros(layout.shape, dtype=layout.dtype, device=device)
        self.scales = list(scales) if scales is not None else [(1.0, 1.0)] * layout.num_layers
        if len(self.scales) != layout.num_layers:
            raise ValueError(f"KV scales for {len(self.scales)} layers, the pool has {layout.num_layers}")

    def kv_scales(self, layer: int) -> tuple[float, float]:
        return self.scales[layer]

    def k_cache(self, layer: int) -> torch.Tensor:
        """[num_pages, kv_heads, page_size, head_dim] view (strided across pages and heads)."""
        return self.buffer[:, :, layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, :, layer, 1]


class PageAllocator:
    """Free-page bookkeeping. Hands out the lowest free ids first so a request's pages tend
    to be consecutive (fewer, larger transfer descriptors). A device pool keeps page 0 back
    as its padding page; a lower tier (reserve_first=False) has none."""

    def __init__(self, num_pages: int, reserve_first: bool = True):
        self.num_pages = num_pages
        self._first = 1 if reserve_first else 0
        self._free = list(range(self._first, num_pages))
        heapq.heapify(self._free)
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def capacity(self) -> int:
        return self.num_pages - self._first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages) -> None:
        for p in pages:
            if p < self._first or self._is_free[p]:
                raise AssertionError(f"double free or padding page freed: page {p}")
            self._is_free[p] = 1
            heapq.heappush(self._free, p)
