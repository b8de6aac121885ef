"""Triton kernel behind kernels.extend_attention (imported lazily: needs triton).

Grid (query blocks, H_q, B). A program holds BLOCK_M queries of one sequence
and one head and streams that sequence's paged KV in BLOCK_N steps with an
online softmax: first the kv positions every query of the block may see (no
mask), then the diagonal steps under the causal mask.

With a work list (kernels.extend_attention.extend_work_items: one (sequence, query
block) per item, -1 past the last) the grid is (items, H_q) instead. A CUDA graph
captures its grid once for every step of its token bucket; sized by (longest extend,
sequences) that grid would be mostly idle programs for a step of many one-token rows
beside a prompt, sized by items it is at most one block per sequence over the
blocks the tokens fill.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2

_LOG2E = 1.4426950408889634


# index arrays and the page-table width vary by batch: no specialisation on them (no recompiles)
@triton.jit(do_not_specialize=["stride_pt_b"],
            do_not_specialize_on_alignment=["page_table", "qo_indptr", "seq_lens", "work"])
def _extend_kernel(
    q, k_cache, v_cache, page_table, qo_indptr, seq_lens, work, o, qk_scale_log2, v_scale,
    stride_q_t, stride_q_h,
    stride_k_page, stride_k_head, stride_k_off,
    stride_v_page, stride_v_head, stride_v_off,
    stride_pt_b, stride_o_t, stride_o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_WORK: tl.constexpr,
):
    head = tl.program_id(1)
    if USE_WORK:  # the list orders each sequence's heaviest (last) blocks first
        item = tl.program_id(0)
        listed = tl.load(work + 2 * item)
        m_block = tl.load(work + 2 * item + 1)
        b = tl.maximum(listed, 0)
    else:  # heaviest (last) query blocks first, so the causal tail does not straggle
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        b = tl.program_id(2)
        listed = b
    q_start = tl.load(qo_indptr + b)
    ext_len = tl.load(qo_indptr + b + 1) - q_start
    if (listed >= 0) & (m_block * BLOCK_M < ext_len):
        seq_len = tl.load(seq_lens + b)
        prefix_len = seq_len - ext_len
        kv_head = head // GROUP

        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < ext_len
        q_pos = prefix_len + m
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        tok = (q_start + m).to(tl.int64)
        qv = tl.load(q + tok[:, None] * stride_q_t + head * stride_q_h + d[None, :],
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        pt_row = page_table + b.to(tl.int64) * stride_pt_b
        k_base = k_cache + kv_head.to(tl.int64) * stride_k_head
        v_base = v_cache + kv_head.to(tl.int64) * stride_v_head

        first_q_pos = prefix_len + m_block * BLOCK_M
        last_q_pos = prefix_len + tl.minimum(m_block * BLOCK_M + BLOCK_M, ext_len) - 1
        full_end = (first_q_pos // BLOCK_N) * BLOCK_N  # steps below every query of the block
        # unmasked steps: every kv position < first_q_pos <= seq_len
        for n0 in range(0, full_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            page = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64)
            off = pos % PAGE_SIZE
            kt = tl.load(k_base + page[:, None] * stride_k_page + off[:, None] * stride_k_off + d[None, :],
                         mask=d_ok[None, :], other=0.0).to(qv.dtype)
            s = tl.dot(qv, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale_log2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + page[:, None] * stride_v_page + off[:, None] * stride_v_off + d[None, :],
                         mask=d_ok[None, :], other=0.0).to(qv.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new
        # diagonal steps: causal mask, and nothing read at or past last_q_pos + 1
        for n0 in range(full_end, last_q_pos + 1, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos <= last_q_pos
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            off = pos % PAGE_SIZE
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_base + page[:, None] * stride_k_page + off[:, None] * stride_k_off + d[None, :],
                         mask=kv_mask, other=0.0).to(qv.dtype)
            s = tl.dot(qv, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale_log2
            # rows past ext_len keep their own (unused) diagonal so they never go all -inf
            s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + page[:, None] * stride_v_page + off[:, None] * stride_v_off + d[None, :],
                         mask=kv_mask, other=0.0).to(qv.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc * v_scale / l_i[:, None]
        tl.store(o + tok[:, None] * stride_o_t + head * stride_o_h + d[None, :],
                 out.to(o.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class ExtendConfig:
    """Tiling of a program's query block and KV steps (docs/performance/kernels.md)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> ExtendConfig:
    if device.type != "cuda":
        return ExtendConfig(32, 16, 4, 1)  # interpreter: small tiles run fastest; M != N like on GPU
    if dtype == torch.float32:
        return ExtendConfig(64, 32, 4, 2)  # fp32 tiles are twice the bytes: stay inside shared memory
    if head_dim <= 64:
        return ExtendConfig(128, 64, 4, 3)  # not swept on the device yet
    # swept: smaller query blocks give more programs for a short prompt's few (query block, head) pairs
    return ExtendConfig(64, 64, 4, 3)


def launch_extend_attention(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale, max_extend_len: int, out=None,
                            config: Optional[ExtendConfig] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                            work=None):
    num_tokens, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or batch == 0 or (work is None and max_extend_len == 0):
        return o
    cfg = config or default_extend_config(head_dim, q.dtype, q.device)
    block_m = cfg.block_m
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if work is not None:  # kernels.extend_attention.ExtendWork
        if work.block_m != block_m:
            raise ValueError(f"the work list was cut in blocks of {work.block_m} query rows; this launch runs "
                             f"{block_m} for q of {q.dtype} and head size {head_dim}")
        grid = (work.items.shape[0], num_q_heads, 1)
    else:
        grid = (triton.cdiv(max_extend_len, block_m), num_q_heads, batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, page_table, qo_indptr, seq_lens, qo_indptr if work is None else work.items, o,
        sm_scale * _LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), o.stride(0), o.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size, DOT_PRECISION=precision,
        USE_WORK=work is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o
