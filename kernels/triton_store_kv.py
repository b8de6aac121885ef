"""Triton kernel behind kernels.store_kv (imported lazily: needs triton)."""

import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE
from kernels.paged_kv import next_power_of_2
from kernels.triton_fp8 import fp8_quantize


@triton.jit(do_not_specialize_on_alignment=["slot_mapping"])
def _store_kv_kernel(
    k_cache, v_cache, k, v, slot_mapping, inv_k_scale, inv_v_scale,
    stride_kc_page, stride_kc_head, stride_kc_off,
    stride_vc_page, stride_vc_head, stride_vc_off,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    num_heads, head_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot < 0 marks a padding token: no heads, so nothing is read or written
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = (h < live_heads)[:, None] & (d < head_dim)[None, :]
    kv_k = tl.load(k + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    kv_v = tl.load(v + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    dst_k = k_cache + page * stride_kc_page + off * stride_kc_off + h[:, None] * stride_kc_head + d[None, :]
    dst_v = v_cache + page * stride_vc_page + off * stride_vc_off + h[:, None] * stride_vc_head + d[None, :]
    if KV_FP8:  # k / k_scale on the fp8 grid (kernels/fp8.py kv_cache_values)
        kv_k = fp8_quantize(kv_k.to(tl.float32), inv_k_scale)
        kv_v = fp8_quantize(kv_v.to(tl.float32), inv_v_scale)
    tl.store(dst_k, kv_k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(dst_v, kv_v.to(v_cache.dtype.element_ty), mask=mask)


def launch_store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        PAGE_SIZE=k_cache.shape[2],
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_D=next_power_of_2(head_dim), KV_FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4,
    )
