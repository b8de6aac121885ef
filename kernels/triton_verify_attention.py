"""Triton kernels behind kernels.verify_attention (imported lazily: needs triton).

Stage 1, grid (B, H_kv, splits): one program reads one split of one sequence's KV for one
kv head once and serves rows (query i, q head g of the group), q_len * GROUP of them, as
one tl.dot tile, with an online softmax under the causal limit of each row's query. A row
whose query sits before the split sees nothing there: it writes lse -inf and zeros (no
NaN from -inf - -inf). Stage 2, grid (B * q_len, H_q): weights the splits by their lse,
as decode attention's stage 2 does. One split: stage 1 writes the output itself."""

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2
from kernels.triton_decode_attention import _num_sms, choose_num_kv_splits

_LOG2E = 1.4426950408889634
BLOCK_N = 64


@triton.jit(do_not_specialize=["stride_pt_b"], do_not_specialize_on_alignment=["page_table", "seq_lens"])
def _verify_stage1(
    q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse, o, qk_scale_log2,
    stride_q_t, stride_q_h,
    stride_k_page, stride_k_head, stride_k_off,
    stride_v_page, stride_v_head, stride_v_off,
    stride_pt_b,
    stride_mo_t, stride_mo_h, stride_mo_s,
    stride_ml_t, stride_ml_h,
    stride_o_t, stride_o_h,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DIRECT_OUT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    r = tl.arange(0, BLOCK_R)
    r_ok = r < Q_LEN * GROUP
    qi = r // GROUP  # which new token
    heads = kv_head * GROUP + r % GROUP
    tok = b.to(tl.int64) * Q_LEN + qi
    q_pos = seq_len - Q_LEN + qi  # the row's query position: it sees kv <= q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    out_mask = r_ok[:, None] & d_ok[None, :]
    o_ptrs = o + tok[:, None] * stride_o_t + heads[:, None] * stride_o_h + d[None, :]

    if start < end:
        qv = tl.load(q + tok[:, None] * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
                     mask=out_mask, other=0.0)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        pt_row = page_table + b.to(tl.int64) * stride_pt_b
        k_base = k_cache + kv_head.to(tl.int64) * stride_k_head
        v_base = v_cache + kv_head.to(tl.int64) * stride_v_head
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            off = pos % PAGE_SIZE
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_base + page[:, None] * stride_k_page + off[:, None] * stride_k_off + d[None, :],
                         mask=kv_mask, other=0.0)
            s = tl.dot(qv, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale_log2
            s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + page[:, None] * stride_v_page + off[:, None] * stride_v_off + d[None, :],
                         mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if DIRECT_OUT:  # the only split holds every row's whole range
            tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=out_mask)
        else:
            mo = mid_o + tok[:, None] * stride_mo_t + heads[:, None] * stride_mo_h + split * stride_mo_s + d[None, :]
            tl.store(mo, out, mask=out_mask)
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(mid_lse + tok * stride_ml_t + heads * stride_ml_h + split, lse, mask=r_ok)
    else:
        if DIRECT_OUT:
            tl.store(o_ptrs, tl.zeros([BLOCK_R, BLOCK_D], tl.float32).to(o.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize_on_alignment=["seq_lens"])
def _verify_stage2(
    mid_o, mid_lse, seq_lens, o,
    stride_mo_t, stride_mo_h, stride_mo_s,
    stride_ml_t, stride_ml_h,
    stride_o_t, stride_o_h,
    Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + t // Q_LEN)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < NUM_SPLITS) & (s * split_len < seq_len)  # stage 1 wrote only these
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t64 = t.to(tl.int64)
    lse = tl.load(mid_lse + t64 * stride_ml_t + h * stride_ml_h + s, mask=s_ok, other=float("-inf"))
    part = tl.load(mid_o + t64 * stride_mo_t + h * stride_mo_h + s[:, None] * stride_mo_s + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(o + t64 * stride_o_t + h * stride_o_h + d, out.to(o.dtype.element_ty), mask=d_ok)


def launch_verify_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, q_len: int,
                            num_kv_splits: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty_like(q) if out is None else out
    if batch == 0:
        return o
    block_r = max(16, next_power_of_2(q_len * group))  # tl.dot needs >= 16 rows
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch, num_kv_heads, page_table.shape[1] * page_size,
                                             _num_sms(q.device))
    direct = num_kv_splits == 1
    if direct:
        mid_o, mid_lse = o.view(num_tokens, num_q_heads, 1, head_dim), o[:, :, 0]
    else:
        mid_o = torch.empty((num_tokens, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _verify_stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse, o, sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        Q_LEN=q_len, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_kv_splits, PAGE_SIZE=page_size, DOT_PRECISION=precision, DIRECT_OUT=direct,
        num_warps=4, num_stages=2,
    )
    if direct:
        return o
    _verify_stage2[(num_tokens, num_q_heads)](
        mid_o, mid_lse, seq_lens, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        Q_LEN=q_len, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_kv_splits, BLOCK_S=max(2, next_power_of_2(num_kv_splits)),
        num_warps=4,
    )
    return o
