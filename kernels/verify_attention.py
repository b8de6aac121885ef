"""Verify attention: a few new query tokens per sequence (speculative decoding's K + 1
positions) over the paged KV cache.

Every sequence b extends by the same q_len tokens: queries b*q_len .. b*q_len + q_len - 1,
query i at position seq_lens[b] - q_len + i, attending causally to kv positions <= its
own. It is extend attention with a uniform extend length; the kernel is built like
flash-decoding instead (the sequence split over programs, one program serving every query
and every q head of one kv head as rows of one tile), because a verify step has a long
cached prefix and a handful of queries: the extend kernel's one program per (q head,
query block) would read the prefix GROUP times and leave most SMs idle at small batch.
The Triton version is CUDA-graph capturable (grid from shapes only, lengths read on the
device)."""

from typing import Optional

import torch

from kernels.extend_attention import extend_attention_reference
from kernels.paged_kv import PagedCacheShape


def _check(q, k_cache, v_cache, page_table, seq_lens, q_len: int) -> PagedCacheShape:
    shape = PagedCacheShape.of(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != shape.head_dim:
        raise ValueError(f"q must be [B*q_len, H_q, {shape.head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % shape.num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={shape.num_kv_heads}")
    batch = seq_lens.shape[0]
    if q_len < 1 or q.shape[0] != batch * q_len:
        raise ValueError(f"q has {q.shape[0]} rows; expected batch ({batch}) x q_len ({q_len})")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError("page_table must be [B, P] and seq_lens [B]")
    return shape


def verify_attention_reference(q, k_cache, v_cache, page_table, seq_lens, sm_scale, q_len: int) -> torch.Tensor:
    """Plain torch (the extend reference with a uniform extend length)."""
    _check(q, k_cache, v_cache, page_table, seq_lens, q_len)
    batch = seq_lens.shape[0]
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q_len
    return extend_attention_reference(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale)


def verify_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, q_len: int,
                     num_kv_splits: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton. num_kv_splits=None picks the split count from the shapes (no sync)."""
    _check(q, k_cache, v_cache, page_table, seq_lens, q_len)
    from kernels.triton_verify_attention import launch_verify_attention

    return launch_verify_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, q_len, num_kv_splits, out)
