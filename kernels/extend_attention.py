"""Extend (prefill with a cached prefix) attention over the paged KV cache.

The new tokens' K/V are already in the cache. Sequence b has extend_len_b =
qo_indptr[b+1] - qo_indptr[b] new queries and seq_lens[b] kv tokens in all;
its query i sits at position seq_lens[b] - extend_len_b + i and attends to kv
positions <= its own (causal over prefix + new tokens).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.fp8 import kv_cache_read
from kernels.paged_kv import PagedCacheShape, gather_dense_kv


def _check(q, k_cache, v_cache, page_table, qo_indptr, seq_lens) -> PagedCacheShape:
    shape = PagedCacheShape.of(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != shape.head_dim:
        raise ValueError(f"q must be [T, H_q, {shape.head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % shape.num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={shape.num_kv_heads}")
    batch = seq_lens.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != batch or qo_indptr.shape != (batch + 1,):
        raise ValueError("page_table must be [B, P], qo_indptr [B+1], seq_lens [B]")
    return shape


def extend_attention_reference(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """Plain torch, float32 math (float64 for float64 inputs), one sequence at a time (CPU or GPU).
    k_scale, v_scale: an FP8 cache's scales (kernels/store_kv.py)."""
    shape = _check(q, k_cache, v_cache, page_table, qo_indptr, seq_lens)
    group = q.shape[1] // shape.num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    out = torch.empty_like(q)
    starts, lens = qo_indptr.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_lo, q_hi = starts[b], starts[b + 1]
        ext = q_hi - q_lo
        if ext == 0:
            continue
        k = kv_cache_read(gather_dense_kv(k_cache, page_table[b], seq_len), acc, k_scale).repeat_interleave(group, dim=1)
        v = kv_cache_read(gather_dense_kv(v_cache, page_table[b], seq_len), acc, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[q_lo:q_hi].to(acc), k) * sm_scale
        q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(kv_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q_lo:q_hi] = torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), v).to(q.dtype)
    return out


def extend_attention(
    q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale,
    max_extend_len: Optional[int] = None, out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0, v_scale: float = 1.0, work: Optional["ExtendWork"] = None,
) -> torch.Tensor:
    """Triton. max_extend_len (the longest extend in the batch) sizes the grid;
    the engine knows it on the host, and without it this reads qo_indptr back
    (one device sync). work (extend_work_items, cut in this q's block_m) sizes it
    instead: no host value at all, as a CUDA graph needs."""
    _check(q, k_cache, v_cache, page_table, qo_indptr, seq_lens)
    from kernels.triton_extend_attention import launch_extend_attention

    if max_extend_len is None and work is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if seq_lens.numel() else 0
    return launch_extend_attention(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale, max_extend_len or 0,
                                   out, k_scale=k_scale, v_scale=v_scale, work=work)


def work_block_m(head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """The query rows one program of the kernel holds, for q of this head size and dtype (a
    work list must be cut in the same blocks)."""
    from kernels.triton_extend_attention import default_extend_config

    return default_extend_config(head_dim, dtype, device).block_m


@dataclass(frozen=True)
class ExtendWork:
    """A work list and the query-block size it was cut in (the launch checks it against its own:
    blocks of another size would leave rows unwritten or written twice)."""

    items: torch.Tensor  # int32 [n, 2]: (sequence, query block), (-1, 0) past the last
    block_m: int


def extend_work_items(qo_indptr: torch.Tensor, block_m: int, items: int,
                      skip_seqs: Optional[torch.Tensor] = None) -> ExtendWork:
    """int32 [items, 2]: (sequence, query block) for each block of block_m new tokens, each
    sequence's last block first, then (-1, 0) past the last. Device ops only, so a CUDA graph
    captures it with the step (its sequences' extends vary from replay to replay).
    `items` must cover the blocks: at most cdiv(tokens, block_m) + the sequences extended.
    skip_seqs (a device count): the sequences below it get no blocks (another kernel computes
    them: a mixed step's leading decode rows, `leading_decode_rows`)."""
    ext = qo_indptr[1:] - qo_indptr[:-1]
    blocks = (ext + (block_m - 1)) // block_m
    if skip_seqs is not None:
        seqs = torch.arange(blocks.shape[0], dtype=torch.int32, device=blocks.device)
        blocks = torch.where(seqs < skip_seqs, 0, blocks)
    ends = torch.cumsum(blocks, 0, dtype=torch.int32)
    i = torch.arange(items, dtype=torch.int32, device=qo_indptr.device)
    seq = torch.searchsorted(ends, i, right=True)
    listed = seq < ends.shape[0]
    safe = seq.clamp(max=ends.shape[0] - 1)
    m_block = ends[safe] - 1 - i  # the sequence's blocks end at ends[seq]: its last block first
    return ExtendWork(torch.stack((torch.where(listed, safe, -1), torch.where(listed, m_block, 0)), 1).to(torch.int32),
                      block_m)


def leading_decode_rows(extend_lens: torch.Tensor, seq_lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixed step's leading one-token sequences (the scheduler puts its decode rows first), on
    the device: (int32 [rows] KV lengths of those among the first `rows`, 0 past them; their count).
    Row i of q is sequence i's token while every sequence before it has one, so the flash-decoding
    kernel can take them (kernels.decode_attention: a zero length writes zeros) and the extend
    kernel the rest (extend_work_items' skip_seqs); device ops only, for a captured step."""
    lead = torch.cumprod((extend_lens[:rows] == 1).to(torch.int32), 0)
    return (seq_lens[:rows] * lead).to(torch.int32), lead.sum().to(torch.int32)
