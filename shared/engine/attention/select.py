"""Pick the attention backend: torch on CPU, triton on GPU, flashinfer when asked and importable."""
from __future__ import annotations

import torch

from ..kv_pool import KVPool


def make_attention_backend(name: str, pool: KVPool, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(pool)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device; use --attention-backend torch")
        from .triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(pool)
    if name == "flashinfer":
        if pool.layout.dtype == torch.float8_e4m3fn:
            raise ValueError("the flashinfer attention backend does not read an FP8 KV cache here; use "
                             "--attention-backend triton (the GPU default) with --kv-cache-dtype fp8_e4m3")
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise ValueError("attention backend 'flashinfer' needs the flashinfer package") from e
        from .flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(pool)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, triton or flashinfer")
