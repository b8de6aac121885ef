"""The attention prologue in one launch: per-head RMSNorm of q and k (Qwen3's q_norm /
k_norm; skipped without weights), rotary embedding of q and k, and optionally the store
of the rotated k and of v into the paged KV cache.

Conventions are those of the modules it fuses: rotary as kernels/rotary_embedding.py
(cos_sin_cache [max_pos, D], cos half then sin half, rotary_dim = head_dim; is_neox
rotates halves, else interleaved pairs), norm as kernels/rms_norm.py (float32 math,
weight applied before rounding), store as kernels/store_kv.py (slot < 0 is padding and
is skipped). q and k are updated in place; like the unfused pair of kernels, the normed
value is rounded to q/k's dtype before it is rotated, so fused and unfused agree.
q is [T, H_q*D] or [T, H_q, D]; k likewise with H_kv heads; the last dim contiguous, the
token stride free (q, k and v can be slices of one qkv output).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.rms_norm import rms_norm_reference
from kernels.rotary_embedding import _as_heads, rotary_embedding_reference
from kernels.store_kv import _check as _check_store
from kernels.store_kv import store_kv_reference


@dataclass(frozen=True)
class KVCacheWrite:
    """Where the rotated k and v go: one layer's paged cache views
    [num_pages, H_kv, page_size, D], v [T, H_kv*D] or [T, H_kv, D], slots [T]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0  # an FP8 cache's scales (kernels/store_kv.py)
    v_scale: float = 1.0


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm weights [D] for q and k, and the epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def _check(positions, q, k, cos_sin_cache, norm: Optional[QKNorm], kv_write: Optional[KVCacheWrite]):
    head_dim = cos_sin_cache.shape[1]
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    qh, kh = _as_heads(q, head_dim), _as_heads(k, head_dim)
    if positions.shape != (qh.shape[0],) or kh.shape[0] != qh.shape[0]:
        raise ValueError("positions must be [T] with q and k of T tokens")
    if norm is not None and (norm.q_weight.shape != (head_dim,) or norm.k_weight.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights must be [{head_dim}]")
    vh = None
    if kv_write is not None:
        vh = _as_heads(kv_write.v, head_dim)
        if vh.shape != kh.shape:
            raise ValueError(f"v must have k's shape {tuple(kh.shape)}, got {tuple(vh.shape)}")
        _check_store(kv_write.k_cache, kv_write.v_cache, kh, vh, kv_write.slot_mapping)
    return head_dim, qh, kh, vh


def qk_norm_rope_reference(positions, q, k, cos_sin_cache, is_neox: bool = True,
                           norm: Optional[QKNorm] = None, kv_write: Optional[KVCacheWrite] = None):
    """The composition of the three torch references; returns (q, k), updated in place."""
    _, qh, kh, vh = _check(positions, q, k, cos_sin_cache, norm, kv_write)
    if norm is not None:
        qh.copy_(rms_norm_reference(qh, norm.q_weight, norm.eps))
        kh.copy_(rms_norm_reference(kh, norm.k_weight, norm.eps))
    rotary_embedding_reference(positions, qh, kh, cos_sin_cache, is_neox)
    if kv_write is not None:
        store_kv_reference(kv_write.k_cache, kv_write.v_cache, kh, vh, kv_write.slot_mapping, kv_write.k_scale,
                           kv_write.v_scale)
    return q, k


def qk_norm_rope(positions, q, k, cos_sin_cache, is_neox: bool = True,
                 norm: Optional[QKNorm] = None, kv_write: Optional[KVCacheWrite] = None, pdl=None):
    """Triton, one launch: one program per (token, head); the k-head programs also store
    that head's k and v. No host syncs (CUDA-graph capturable). pdl: a kernels.pdl.Pdl to
    launch with programmatic dependent launch (Hopper+)."""
    _, qh, kh, vh = _check(positions, q, k, cos_sin_cache, norm, kv_write)
    from kernels.triton_qk_norm_rope import launch_qk_norm_rope

    launch_qk_norm_rope(positions, qh, kh, cos_sin_cache, is_neox, norm, kv_write, vh, pdl)
    return q, k
