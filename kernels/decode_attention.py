"""Decode attention over the paged KV cache: one new query token per sequence.

GQA: H_q is a multiple of H_kv; q head h reads kv head h // (H_q // H_kv).
The Triton version is flash-decoding (split the sequence, reduce partials with
their log-sum-exp) and is CUDA-graph capturable: no host syncs, the grid
depends only on B, H and the split count, seq_lens are read on the device.
"""

from typing import Optional

import torch

from kernels.fp8 import kv_cache_read
from kernels.paged_kv import PagedCacheShape, gather_dense_kv


def _check(q, k_cache, v_cache, page_table, seq_lens) -> PagedCacheShape:
    shape = PagedCacheShape.of(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != shape.head_dim:
        raise ValueError(f"q must be [B, H_q, {shape.head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % shape.num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={shape.num_kv_heads}")
    batch = q.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("page_table must be [B, P] and seq_lens [B]")
    return shape


def decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, sm_scale, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """Plain torch, float32 math (float64 for float64 inputs), one sequence at a time (CPU or GPU).
    A sequence with seq_len 0 (a padded batch slot) gets zeros. k_scale, v_scale: an FP8
    cache's scales (kernels/store_kv.py)."""
    shape = _check(q, k_cache, v_cache, page_table, seq_lens)
    group = q.shape[1] // shape.num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        k = kv_cache_read(gather_dense_kv(k_cache, page_table[b], length), acc, k_scale)  # [L, H_kv, D]
        v = kv_cache_read(gather_dense_kv(v_cache, page_table[b], length), acc, v_scale)
        k = k.repeat_interleave(group, dim=1)  # [L, H_q, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].to(acc), k) * sm_scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return out


def decode_attention(
    q, k_cache, v_cache, page_table, seq_lens, sm_scale,
    num_kv_splits: Optional[int] = None, out: Optional[torch.Tensor] = None, pdl=None,
    k_scale: float = 1.0, v_scale: float = 1.0, sized_as: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Triton flash-decoding. num_kv_splits=None picks the split count from
    the batch size and the page table's capacity (shapes only, no sync).
    out: optional preallocated [B, H_q, D] output (e.g. a CUDA graph's buffer).
    pdl: a kernels.pdl.Pdl to launch with programmatic dependent launch (Hopper+).
    k_scale, v_scale: an FP8 cache's scales (1.0 for other caches).
    sized_as: (rows, KV capacity in tokens) to choose the splits and tiling for instead of the
    batch's (rows of which only some are live; a launch variant compiled already)."""
    _check(q, k_cache, v_cache, page_table, seq_lens)
    from kernels.triton_decode_attention import launch_decode_attention

    return launch_decode_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, num_kv_splits, out,
                                   pdl=pdl, k_scale=k_scale, v_scale=v_scale, sized_as=sized_as)
