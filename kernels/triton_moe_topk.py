"""The MoE router's top-k as Triton device functions, shared by the grouped-GEMM path's
select-experts kernel (triton_fused_moe.py) and the decode router (triton_moe_decode.py); the
reference is fused_moe.select_experts_reference.

On one row of router logits: HF's softmax in float32, the k largest probabilities in slot
order (k rounds of max + argmax, or one sort of packed keys: the same experts and slots,
ties to the lower expert), optionally renormalised over the k and rounded to the model's
dtype, then stored as (weights float32, expert ids int32)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype for the kernels' dtype constexprs (ROUND_TO None: no rounding)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _softmax(x, ok):
    """HF's router probabilities: softmax in float32 over the logits x (masked by ok)."""
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p, 0.0)
    return p / tl.sum(p, axis=0)


@triton.jit
def _store_topk(vals, idxs, slots, weights_out, ids_out, row, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                ROUND_TO: tl.constexpr):
    """The slots < TOP_K of vals / idxs (slot order): optional renormalisation and rounding of
    the weights, then both stored."""
    top = slots < TOP_K
    if RENORM:
        vals = vals / tl.sum(tl.where(top, vals, 0.0), axis=0)
    if ROUND_TO is not None:
        vals = vals.to(ROUND_TO).to(tl.float32)
    tl.store(weights_out + row * TOP_K + slots, vals, mask=top)
    tl.store(ids_out + row * TOP_K + slots, idxs, mask=top)


@triton.jit
def softmax_topk(x, ok, cols, weights_out, ids_out, row, TOP_K: tl.constexpr, TOP_KP: tl.constexpr,
                 RENORM: tl.constexpr, ROUND_TO: tl.constexpr):
    """HF's router on a row of logits: softmax, k rounds of argmax, renormalise / round."""
    p = _softmax(x, ok)
    slots = tl.arange(0, TOP_KP)
    vals = tl.zeros([TOP_KP], tl.float32)
    idxs = tl.zeros([TOP_KP], tl.int32)
    for j in tl.static_range(TOP_K):
        v = tl.max(p, axis=0)
        i = tl.argmax(p, axis=0)
        vals = tl.where(slots == j, v, vals)
        idxs = tl.where(slots == j, i, idxs)
        p = tl.where(cols == i, -1.0, p)
    _store_topk(vals, idxs, slots, weights_out, ids_out, row, TOP_K, RENORM, ROUND_TO)


@triton.jit
def softmax_topk_sorted(x, ok, cols, weights_out, ids_out, row, TOP_K: tl.constexpr, EP: tl.constexpr,
                        RENORM: tl.constexpr, ROUND_TO: tl.constexpr):
    """softmax_topk with one sort in place of TOP_K rounds of max + argmax (each round two
    cross-warp reductions). Sort keys pack the probability's bits (non-negative floats order
    as their int bits) above EP-1-index, so equal probabilities keep the lower expert first,
    as argmax does; padding sorts last."""
    p = _softmax(x, ok)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(ok, (bits << 32) | (EP - 1 - cols).to(tl.int64), -1)
    key = tl.sort(key, 0, descending=True)  # position j holds the j-th largest
    vals = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    idxs = (EP - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    _store_topk(vals, idxs, cols, weights_out, ids_out, row, TOP_K, RENORM, ROUND_TO)
