"""Mixture-of-experts layer on the GPU: routing (softmax top-k) and the experts' SwiGLU MLPs
as grouped GEMMs over tokens sorted by expert.

Shapes: x [T, H]; w13 [E, 2I, H] holds every local expert's gate rows [0, I) then up rows
[I, 2I) (the HF layout stacked, K-major); w2 [E, H, I]; topk_weights [T, k] float32 and
topk_ids [T, k] int32 (global expert ids). expert_map (int32 [E_global], -1 for experts
another rank holds) turns global ids into local ones: expert parallelism.

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
    e = expert_map[topk_ids[t, j]] (slots whose expert is elsewhere contribute nothing)

The Triton path (triton_fused_moe.py): one kernel sorts the T*k (token, slot) pairs by
expert and pads each expert's run to the GEMM's row block; a grouped GEMM computes gate and
up for each block of its expert and writes silu(g)*u (the intermediate is [T*k, I], never
[T*k, 2I]); a second grouped GEMM applies w2 and the routing weight; the k rows of a token
are summed in a fixed order (deterministic: no atomics anywhere). Every size is fixed by
(T, k, E, block): no host sync, CUDA-graph safe; programs past the padded count exit.
Rounding follows the unfused path: gate and up rounded to the activation dtype before
SwiGLU, the intermediate and each expert's output rounded before weighting and summing."""
from __future__ import annotations

from typing import Optional

import torch


def select_experts_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """HF's router: softmax in float32, top-k, optional renormalisation.
    Returns (weights float32 [T, k], ids int32 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights_to=None):
    """Triton: one program per token (softmax, k rounds of argmax, renormalise).
    round_weights_to: a dtype the weights are rounded to (kept as float32 values), as HF's
    Qwen routers cast them to the activations' dtype; done in the kernel, not as extra casts."""
    if router_logits.dim() != 2 or not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(f"router_logits must be [T, E] with 0 < top_k <= E, got {tuple(router_logits.shape)}, "
                         f"top_k={top_k}")
    from kernels.triton_fused_moe import launch_select_experts

    return launch_select_experts(router_logits, top_k, renormalize, round_weights_to)


def _check(x, w13, w2, topk_weights, topk_ids, expert_map):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights must be in x's dtype {x.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype != torch.int32):
        raise ValueError("expert_map must be int32 [E_global]")


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids, *, expert_map: Optional[torch.Tensor] = None):
    """Plain torch, in float32 (float64 for float64 inputs), with the kernel's rounding
    points: gate/up, the intermediate and each expert's output in x's dtype."""
    _check(x, w13, w2, topk_weights, topk_ids, expert_map)
    acc = torch.promote_types(x.dtype, torch.float32)
    t, k = topk_ids.shape
    i = w2.shape[2]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    out = torch.zeros(t, k, x.shape[1], dtype=acc, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.where(ids == e)
        gu = (x[tok].to(acc) @ w13[e].to(acc).T).to(x.dtype).to(acc)
        gate, up = gu[:, :i], gu[:, i:]
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).to(acc)
        y = (h @ w2[e].to(acc).T).to(x.dtype).to(acc)
        out[tok, slot] = y * topk_weights[tok, slot, None].to(acc)
    return out.sum(dim=1).to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, expert_map: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None, config=None) -> torch.Tensor:
    """Triton fused MoE (see the module note). config: a MoEConfig of tile sizes for both
    grouped GEMMs; None: kernels/fused_moe_config.py picks by T. (The fewest tokens go
    through kernels/moe_decode.py instead: per-pair GEMVs, no sort.)"""
    _check(x, w13, w2, topk_weights, topk_ids, expert_map)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    from kernels.triton_fused_moe import launch_fused_moe

    return launch_fused_moe(x, w13, w2, topk_weights.float(), topk_ids, expert_map, out, config)
