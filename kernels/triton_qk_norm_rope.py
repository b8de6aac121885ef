"""Triton kernel behind kernels.qk_norm_rope (imported lazily: needs triton).

Grid (T, H_q + H_kv): one program per (token, head), as TensorRT-LLM's and vLLM's fused
q/k-norm + RoPE kernels give each head its own warp. A head is loaded as its two rotary
halves (or even/odd lanes for GPT-J), so the norm's sum of squares and the rotation both
work on the same registers. Programs of k heads also write k and v at the token's slot.
"""

import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE
from kernels.paged_kv import next_power_of_2
from kernels.pdl import launch_options, pdl_for, pdl_wait_first
from kernels.triton_fp8 import fp8_quantize
from kernels.triton_pdl import pdl_enter


@triton.jit
def _norm_rotate_head(x, w, eps, cos, sin, i, i_ok,
                      HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
    """Norm (optional) then rotate one head at x in place; returns the rotated halves
    (in x's dtype) and their offsets."""
    if IS_NEOX:
        o1 = i
        o2 = i + HALF
    else:
        o1 = 2 * i
        o2 = 2 * i + 1
    x1 = tl.load(x + o1, mask=i_ok, other=0.0).to(tl.float32)
    x2 = tl.load(x + o2, mask=i_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(w + o1, mask=i_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w + o2, mask=i_ok, other=0.0).to(tl.float32)
        # rounded to x's dtype as the unfused rms_norm output is, then rotated
        x1 = (x1 * inv_rms * w1).to(x.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms * w2).to(x.dtype.element_ty).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(x.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(x.dtype.element_ty)
    tl.store(x + o1, r1, mask=i_ok)
    tl.store(x + o2, r2, mask=i_ok)
    return r1, r2, o1, o2


@triton.jit(do_not_specialize_on_alignment=["positions", "slot_mapping"])
def _qk_norm_rope_kernel(
    positions, q, k, v, cos_sin_cache, q_weight, k_weight, eps,
    k_cache, v_cache, slot_mapping, inv_k_scale, inv_v_scale,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_cache,
    stride_kc_page, stride_kc_head, stride_kc_off,
    stride_vc_page, stride_vc_head, stride_vc_off,
    num_q_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, HAS_STORE: tl.constexpr, PDL: tl.constexpr,
    WAIT_FIRST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    pdl_enter(PDL, WAIT_FIRST)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cache + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    if head < num_q_heads:
        _norm_rotate_head(q + tok * stride_q_t + head * stride_q_h, q_weight, eps, cos, sin, i, i_ok,
                          HALF, IS_NEOX, HAS_NORM)
    else:
        kv_head = head - num_q_heads
        r1, r2, o1, o2 = _norm_rotate_head(k + tok * stride_k_t + kv_head * stride_k_h, k_weight, eps,
                                           cos, sin, i, i_ok, HALF, IS_NEOX, HAS_NORM)
        if HAS_STORE:
            slot = tl.load(slot_mapping + tok).to(tl.int64)
            if slot >= 0:  # slot < 0: a padding token, nothing is written
                page = slot // PAGE_SIZE
                off = slot % PAGE_SIZE
                dst_k = k_cache + page * stride_kc_page + kv_head * stride_kc_head + off * stride_kc_off
                src_v = v + tok * stride_v_t + kv_head * stride_v_h
                dst_v = v_cache + page * stride_vc_page + kv_head * stride_vc_head + off * stride_vc_off
                v1 = tl.load(src_v + i, mask=i_ok)
                v2 = tl.load(src_v + HALF + i, mask=i_ok)
                # the rotated k (rounded to k's dtype) and v over their scales, on the fp8 grid;
                # new names per branch: Triton refuses a variable whose type an `if` changes
                if KV_FP8:
                    k1_out = fp8_quantize(r1.to(tl.float32), inv_k_scale)
                    k2_out = fp8_quantize(r2.to(tl.float32), inv_k_scale)
                    v1_out = fp8_quantize(v1.to(tl.float32), inv_v_scale)
                    v2_out = fp8_quantize(v2.to(tl.float32), inv_v_scale)
                else:
                    k1_out = r1.to(tl.float32)
                    k2_out = r2.to(tl.float32)
                    v1_out = v1.to(tl.float32)
                    v2_out = v2.to(tl.float32)
                tl.store(dst_k + o1, k1_out.to(k_cache.dtype.element_ty), mask=i_ok)
                tl.store(dst_k + o2, k2_out.to(k_cache.dtype.element_ty), mask=i_ok)
                tl.store(dst_v + i, v1_out.to(v_cache.dtype.element_ty), mask=i_ok)
                tl.store(dst_v + HALF + i, v2_out.to(v_cache.dtype.element_ty), mask=i_ok)


def launch_qk_norm_rope(positions, q, k, cos_sin_cache, is_neox, norm, kv_write, v, pdl=None) -> None:
    """q [T, H_q, D], k and v [T, H_kv, D] (v None without kv_write), last dims contiguous."""
    num_tokens, num_q_heads, _ = q.shape
    if num_tokens == 0:
        return
    pdl = pdl_for(pdl, num_tokens)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs a contiguous last dim in q, k and cos_sin_cache")
    half = cos_sin_cache.shape[1] // 2
    if kv_write is not None:
        if v.stride(-1) != 1:
            v = v.contiguous()
        kc, vc, slots = kv_write.k_cache, kv_write.v_cache, kv_write.slot_mapping
        page_size = kc.shape[2]
        inv_scales = (1.0 / kv_write.k_scale, 1.0 / kv_write.v_scale)
    else:  # unused pointers when HAS_STORE is False
        v, kc, vc, slots, page_size = k, k, k, positions, 1
        inv_scales = (1.0, 1.0)
    q_w = norm.q_weight if norm is not None else q
    k_w = norm.k_weight if norm is not None else k
    eps = norm.eps if norm is not None else 0.0
    kc_strides = (kc.stride(0), kc.stride(1), kc.stride(2)) if kv_write is not None else (0, 0, 0)
    vc_strides = (vc.stride(0), vc.stride(1), vc.stride(2)) if kv_write is not None else (0, 0, 0)
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + k.shape[1])](
        positions, q, k, v, cos_sin_cache, q_w, k_w, eps,
        kc, vc, slots, *inv_scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *kc_strides, *vc_strides,
        num_q_heads,
        HALF=half, BLOCK_HALF=next_power_of_2(half), PAGE_SIZE=page_size,
        IS_NEOX=is_neox, HAS_NORM=norm is not None, HAS_STORE=kv_write is not None, PDL=pdl is not None,
        WAIT_FIRST=pdl_wait_first(pdl, num_tokens),
        KV_FP8=kv_write is not None and kc.dtype == FP8_DTYPE, num_warps=1, **launch_options(pdl),
    )
