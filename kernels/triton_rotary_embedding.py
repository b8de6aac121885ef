"""Triton kernel behind kernels.rotary_embedding (imported lazily: needs triton)."""

import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2


@triton.jit
def _rotate_heads(x, row_off, stride_h, num_heads, cos, sin, i, i_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & i_ok[None, :]
    if IS_NEOX:
        o1 = i
        o2 = i + HALF
    else:
        o1 = 2 * i
        o2 = 2 * i + 1
    p1 = x + row_off + h[:, None] * stride_h + o1[None, :]
    p2 = x + row_off + h[:, None] * stride_h + o2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(x.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(x.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["positions"])
def _rotary_kernel(
    positions, q, k, cos_sin_cache,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cache,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cache + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate_heads(q, tok * stride_q_t, stride_q_h, num_q_heads, cos, sin, i, i_ok, HALF, BLOCK_HQ, IS_NEOX)
    _rotate_heads(k, tok * stride_k_t, stride_k_h, num_kv_heads, cos, sin, i, i_ok, HALF, BLOCK_HK, IS_NEOX)


def launch_rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool) -> None:
    """q [T, H_q, D], k [T, H_kv, D], both with a contiguous last dim."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dim in q, k and cos_sin_cache")
    half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        IS_NEOX=is_neox, num_warps=4,
    )
