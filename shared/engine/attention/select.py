"""The attention backend of a name the engine plan resolved (plan_resolve.py picks it: torch on
CPU, triton on GPU, flashinfer when asked and importable, and refuses what the device lacks)."""
from __future__ import annotations

from ..kv_pool import KVPool

NAMES = ("torch", "triton", "flashinfer")


def backend_class(name: str) -> type:
    """The backend class of `name` (imported here: triton's and flashinfer's need their packages)."""
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend
    if name == "triton":
        from .triton_backend import TritonAttentionBackend
        return TritonAttentionBackend
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(NAMES)}")


def make_attention_backend(name: str, pool: KVPool):
    return backend_class(name)(pool)
