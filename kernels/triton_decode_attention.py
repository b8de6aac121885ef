"""Triton kernels behind kernels.decode_attention (imported lazily: needs triton).

Stage 1, grid (B, H_kv * head_blocks, splits): one program reads one split of
one sequence's KV for one kv head once and serves all the q heads of its group
(rows of a tl.dot), keeping an online softmax; it writes its partial output and
log-sum-exp (base 2). Stage 2, grid (B, H_q): weights the splits by their lse.
With one split there is nothing to reduce: stage 1 writes the output itself and
stage 2 is not launched (one launch per layer instead of two; SGLang's decode
kernels drop their reduce step the same way).
Each sequence divides its own length over the splits on the device, so the
grid is fixed for a given B and split count (CUDA graphs).
An FP8 cache is widened as it is read (exact); its k_scale rides in the softmax scale and its
v_scale multiplies each split's output (kernels/store_kv.py). With a 16-bit q (KV_F16) the pages
widen to fp16, one conversion per two values against two to bf16, and q goes to fp16 with a power
of two per head (kernels/triton_f16_rows.py); exact either way. Its effect alone was not measured:
what moved FP8 pages at long context was the tiling (default_config, choose_num_kv_splits).
Else (fp32 q, 16-bit pages) pages widen to q's dtype.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2
from kernels.pdl import Pdl, launch_options, pdl_for, pdl_late, pdl_wait_first
from kernels.triton_f16_rows import rows_to_f16
from kernels.triton_pdl import pdl_enter, pdl_enter_late, pdl_release, prefetch_l2

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 32
# Under PDL, stage 1 asks L2 for its split's K/V while the kernel before runs (False: off, to
# measure it against), on batches of up to PDL_KV_PREFETCH_MAX_ROWS. One or two rows' pages are
# a short dependent-load chain worth starting early; from four rows the pages compete with the
# kernel before for bandwidth and, at 16-32 rows, with each other in L2, and the step slows
# (docs/performance/pdl.md).
PDL_KV_PREFETCH = True
PDL_KV_PREFETCH_MAX_ROWS = 2


@dataclass(frozen=True)
class DecodeConfig:
    """Stage-1 tiling (docs/performance/kernels.md: tilings within a few percent of each other at 1k context)."""

    block_n: int = 64  # kv tokens per inner step
    num_warps: int = 4
    num_stages: int = 2
    direct_single_split: bool = True  # one split: stage 1 writes o, no stage 2 (False: benchmarks' "before")


@triton.jit
def _prefetch_split(seq_len_ptr, pt_row, pt_width, num_pages, k_base, v_base, split,
                    stride_k_page, stride_k_off, stride_v_page, stride_v_off,
                    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    HEAD_DIM: tl.constexpr, LINE_ELEMS: tl.constexpr, LINES: tl.constexpr):
    """L2 prefetches of the K and V rows this program's split will read (128-byte lines). Every
    index is clamped into its table: what is read here only steers hints."""
    seq_len = tl.load(seq_len_ptr)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    line = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, HEAD_DIM - 1)  # LINES: a power of two
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        pos = tl.where(pos_ok, pos, start)  # past the split: its first row again (already asked for)
        page = tl.load(pt_row + tl.minimum(pos // PAGE_SIZE, pt_width - 1))
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        off = pos % PAGE_SIZE
        prefetch_l2(k_base + (page * stride_k_page + off * stride_k_off)[:, None] + line[None, :])
        prefetch_l2(v_base + (page * stride_v_page + off * stride_v_off)[:, None] + line[None, :])


# batch index arrays are slices at any offset and the page-table width varies by batch: not
# specialised on (a serving batch would compile a variant warm-up never met: shared/engine/warmup.py)
@triton.jit(do_not_specialize=["stride_pt_b", "pt_width", "num_pages"],
            do_not_specialize_on_alignment=["page_table", "seq_lens"])
def _decode_stage1(
    q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse, o, qk_scale_log2, v_scale, pt_width, num_pages,
    stride_q_b, stride_q_h,
    stride_k_page, stride_k_head, stride_k_off,
    stride_v_page, stride_v_head, stride_v_off,
    stride_pt_b,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_o_b, stride_o_h,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIRECT_OUT: tl.constexpr, PDL: tl.constexpr, KV_F16: tl.constexpr,
    PREFETCH: tl.constexpr, LINE_ELEMS: tl.constexpr, LINES: tl.constexpr, PDL_LATE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    pt_row = page_table + b.to(tl.int64) * stride_pt_b
    k_base = k_cache + kv_head.to(tl.int64) * stride_k_head
    v_base = v_cache + kv_head.to(tl.int64) * stride_v_head
    if PREFETCH:
        # While the kernel before (the new token's K/V store) runs, ask L2 for this split's
        # pages: the host wrote seq_lens and the page table before the step's first kernel, the
        # older tokens' K/V are earlier steps', and a prefetch is only a hint (the one line the
        # kernel before writes is fetched again after the wait). At one row the step's attention
        # is that chain of dependent loads, not bytes, so starting it early shortens the step.
        _prefetch_split(seq_lens + b, pt_row, pt_width, num_pages, k_base, v_base, split,
                        stride_k_page, stride_k_off, stride_v_page, stride_v_off,
                        NUM_SPLITS, BLOCK_N, PAGE_SIZE, HEAD_DIM, LINE_ELEMS, LINES)
    pdl_enter_late(PDL, PDL_LATE)

    seq_len = tl.load(seq_lens + b)
    # split length rounded up to whole BLOCK_N steps keeps loads aligned
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    local = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local < GROUP
    heads = kv_head * GROUP + local
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    out_mask = head_ok[:, None] & d_ok[None, :]
    o_ptrs = o + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + d[None, :]

    if start < end:
        qv = tl.load(
            q + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + d[None, :],
            mask=head_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if KV_F16:  # fp16 q, the per-head power of two folded into the scores' scale
            qv, q_down = rows_to_f16(qv)
            s_scale = qk_scale_log2 * q_down[:, None]
        else:
            s_scale = qk_scale_log2
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            off = pos % PAGE_SIZE
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            kt = tl.load(
                k_base + page[:, None] * stride_k_page + off[:, None] * stride_k_off + d[None, :],
                mask=kv_mask, other=0.0,
            ).to(qv.dtype)  # an FP8 cache widens exactly; its k_scale is in qk_scale_log2
            s = tl.dot(qv, tl.trans(kt), input_precision=DOT_PRECISION) * s_scale
            s = tl.where(pos_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(
                v_base + page[:, None] * stride_v_page + off[:, None] * stride_v_off + d[None, :],
                mask=kv_mask, other=0.0,
            ).to(qv.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new
        pdl_release(PDL, PDL_LATE)
        acc = acc * v_scale  # an FP8 cache's v_scale (1.0 otherwise)
        if DIRECT_OUT:  # the only split: this is the output
            tl.store(o_ptrs, (acc / l_i[:, None]).to(o.dtype.element_ty), mask=out_mask)
        else:
            mo = mid_o + b.to(tl.int64) * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + d[None, :]
            tl.store(mo, acc / l_i[:, None], mask=out_mask)
            ml = mid_lse + b.to(tl.int64) * stride_ml_b + heads * stride_ml_h + split
            tl.store(ml, m_i + tl.log2(l_i), mask=head_ok)
    else:
        if DIRECT_OUT:  # seq_len 0 (a padded slot): zeros, as stage 2 would give
            tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(o.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize_on_alignment=["seq_lens"])
def _decode_stage2(
    mid_o, mid_lse, seq_lens, o,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_o_b, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, WAIT_FIRST: tl.constexpr,
):
    pdl_enter(PDL, WAIT_FIRST)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, BLOCK_S)
    # stage 1 wrote only the splits that hold tokens; never read the others
    s_ok = (s < NUM_SPLITS) & (s * split_len < seq_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(mid_lse + b.to(tl.int64) * stride_ml_b + h * stride_ml_h + s, mask=s_ok, other=float("-inf"))
    part = tl.load(
        mid_o + b.to(tl.int64) * stride_mo_b + h * stride_mo_h + s[:, None] * stride_mo_s + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: every weight is 0
    w = tl.exp2(lse - m)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(o + b.to(tl.int64) * stride_o_b + h * stride_o_h + d, out.to(o.dtype.element_ty), mask=d_ok)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number keeps the grids small


# Long page tables and FP8 pages: a long table's K/V stream is long enough for a third stage to
# pay; the FP8 tile's widening and layout change leave less to overlap, so more programs (~8 an
# SM) and longer steps keep the bytes in flight. Short tables keep the tiling swept at 1k
# context. Figures: docs/performance/kernels.md.
LONG_CAPACITY = 8192
LONG_BF16 = DecodeConfig(64, 4, 3)
FP8_PAGES = DecodeConfig(128, 4, 2)


def default_config(kv_capacity: int, fp8_pages: bool) -> DecodeConfig:
    """The stage-1 tiling for a page table of kv_capacity tokens (fixed per CUDA graph)."""
    if fp8_pages:
        return FP8_PAGES
    return LONG_BF16 if kv_capacity >= LONG_CAPACITY else DecodeConfig()


def choose_num_kv_splits(batch: int, kv_programs_per_seq: int, kv_capacity: int, num_sms: int,
                         programs_per_sm: int = 2) -> int:
    """Enough splits to give every SM about programs_per_sm programs (8 for FP8 pages), but never
    splits shorter than _MIN_TOKENS_PER_SPLIT of the page table's capacity."""
    wanted = triton.cdiv(programs_per_sm * num_sms, max(1, batch * kv_programs_per_seq))
    by_length = triton.cdiv(kv_capacity, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def launch_decode_attention(
    q, k_cache, v_cache, page_table, seq_lens, sm_scale,
    num_kv_splits: Optional[int] = None, out: Optional[torch.Tensor] = None,
    config: Optional[DecodeConfig] = None, pdl: Optional[Pdl] = None, k_scale: float = 1.0, v_scale: float = 1.0,
    sized_as: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    fp8_pages = k_cache.element_size() == 1
    split_rows, capacity = sized_as or (batch, page_table.shape[1] * page_size)
    cfg = config or default_config(capacity, fp8_pages)
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_h = min(max(16, next_power_of_2(group)), 64)  # tl.dot needs >= 16 rows
    head_blocks = triton.cdiv(group, block_h)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            split_rows, num_kv_heads * head_blocks, capacity, _num_sms(q.device),
            programs_per_sm=8 if fp8_pages else 2,
        )
    o = torch.empty_like(q) if out is None else out
    if batch == 0:
        return o
    pdl = pdl_for(pdl, batch)
    direct = num_kv_splits == 1 and cfg.direct_single_split
    if direct:  # no partials: stage 1 writes o; the mid pointers are never used (no allocation)
        mid_o, mid_lse = o.view(batch, num_q_heads, 1, head_dim), o[:, :, 0]
    else:
        mid_o = torch.empty((batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_stage1[(batch, num_kv_heads * head_blocks, num_kv_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse, o, sm_scale * _LOG2E * k_scale, v_scale,
        page_table.shape[1], k_cache.shape[0],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        NUM_SPLITS=num_kv_splits, PAGE_SIZE=page_size, DOT_PRECISION=precision,
        DIRECT_OUT=direct, PDL=pdl is not None,
        KV_F16=k_cache.element_size() == 1 and q.dtype in (torch.bfloat16, torch.float16),
        PREFETCH=pdl is not None and PDL_KV_PREFETCH and batch <= PDL_KV_PREFETCH_MAX_ROWS,
        LINE_ELEMS=128 // k_cache.element_size(), PDL_LATE=pdl_late(pdl, batch),
        LINES=next_power_of_2(triton.cdiv(head_dim * k_cache.element_size(), 128)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    if direct:
        return o
    _decode_stage2[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        NUM_SPLITS=num_kv_splits, BLOCK_S=max(2, next_power_of_2(num_kv_splits)), PDL=pdl is not None,
        WAIT_FIRST=pdl_wait_first(pdl, batch),
        num_warps=4, **launch_options(pdl),
    )
    return o
