"""The attention-backend interface: store this step's K/V into the paged pool and attend.

Backends get explicit CUDA-graph hooks: buffers sized for the largest captured batch are
made once (init_graph_state), capture runs over those static buffers (capture_metadata),
and each replay copies the step's metadata into them (replay_metadata)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..kv_pool import KVPool
from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    name = "base"

    def __init__(self, pool: KVPool):
        self.pool = pool

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the layers run (plan split sizes, etc.)."""

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k, v) cache views [num_pages, Hkv, page_size, D] that forward reads for
        `layer`: a fused kernel writes this step's K/V there, then calls forward with
        kv_stored=True."""
        return self.pool.k_cache(layer), self.pool.v_cache(layer)

    def kv_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer`'s cache: what an FP8 cache's values are multiplied
        by when read (and divided by when written); 1.0 for a 16/32-bit cache."""
        return self.pool.kv_scales(layer)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]; writes k/v at meta.slot_mapping
        unless the caller already did (kv_stored, e.g. kernels.qk_norm_rope)."""

    # -- CUDA graph hooks (decode only) ---------------------------------------------------
    supports_cuda_graph = False

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        raise NotImplementedError(f"{self.name} backend does not support CUDA graphs")

    def capture_metadata(self, bs: int) -> AttentionMetadata:
        raise NotImplementedError

    def replay_metadata(self, meta: AttentionMetadata, bs: int) -> None:
        raise NotImplementedError
