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

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]; writes k/v at meta.slot_mapping."""

    # -- CUDA graph hooks (decode only) ---------------------------------------------------
    supports_cuda_graph = False

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        raise NotImplementedError(f"{self.name} backend does not support CUDA graphs")

    def capture_metadata(self, bs: int) -> AttentionMetadata:
        raise NotImplementedError

    def replay_metadata(self, meta: AttentionMetadata, bs: int) -> None:
        raise NotImplementedError
