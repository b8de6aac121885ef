"""Mixture-of-experts layers over FP8 experts (kernels/fp8.py's Fp8Weight of [E, 2I, H] and
[E, H, I], one scale row map per weight shared by every expert).

- fused_moe_fp8 (prefill, and decode batches above the per-pair path): kernels/fused_moe.py's
  grouped GEMMs in W8A8: x quantized per token per 128-column group, the SwiGLU intermediate
  per (token, slot) row and group, each K step of a GEMM an FP8 tensor-core dot scaled by
  both (triton_fp8_moe.py). The sort, the epilogues and the deterministic top-k sum are
  those of the 16-bit path.
- experts_fp8 (the fewest tokens): kernels/moe_decode.py's one-launch experts kernel reading
  FP8 weights (W8A16: x stays 16-bit, the weights are widened and scaled in registers), the
  routing launch unchanged.
Both CUDA-graph safe like their 16-bit twins. The references follow the same rounding points:
activations quantized where the kernel quantizes them, gate/up, the intermediate and each
expert's output rounded to x's dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from kernels.fp8 import FP8_DTYPE, Fp8Weight, dequantize_activations, per_token_group_quant_reference
from kernels.fp8_linear import act_group
from kernels.moe_decode import DecodeCounters, DecodeTile, _check_counters


def _check(x, w13: Fp8Weight, w2: Fp8Weight, topk_weights, topk_ids, expert_map):
    if x.dim() != 2 or w13.q.dim() != 3 or w2.q.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    e, two_i, h = w13.q.shape
    if h != x.shape[1] or two_i % 2 or w2.q.shape != (e, h, two_i // 2):
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.q.shape)}, w2 {tuple(w2.q.shape)}")
    if w13.q.dtype != FP8_DTYPE or w2.q.dtype != FP8_DTYPE:
        raise ValueError("FP8 experts hold float8_e4m3fn weights")
    if w13.scale_row.shape != (two_i,) or w2.scale_row.shape != (h,) or w13.group_k != w2.group_k:
        raise ValueError("scale rows must be [2I] and [H], and both weights share one K group")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype != torch.int32):
        raise ValueError("expert_map must be int32 [E_global]")


def fused_moe_fp8_reference(x, w13: Fp8Weight, w2: Fp8Weight, topk_weights, topk_ids, *,
                            expert_map: Optional[torch.Tensor] = None, quantize_activations: bool = True):
    """Torch, float64 products. quantize_activations: W8A8 as fused_moe_fp8 (x and the
    intermediate through per-token-group FP8); False: W8A16 as experts_fp8."""
    _check(x, w13, w2, topk_weights, topk_ids, expert_map)
    group = act_group(w13)

    def act(v):
        if not quantize_activations:
            return v.double()
        q, s = per_token_group_quant_reference(v, group)
        return dequantize_activations(q, s, group).double()

    t, k = topk_ids.shape
    i = w2.q.shape[2]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    w13d, w2d = w13.dequantize(torch.float64), w2.dequantize(torch.float64)
    xa = act(x)
    out = torch.zeros(t, k, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.where(ids == e)
        gu = (xa[tok] @ w13d[e].T).to(x.dtype).double()
        h = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).to(x.dtype)
        y = (act(h) @ w2d[e].T).to(x.dtype).double()
        out[tok, slot] = y * topk_weights[tok, slot, None].double()
    return out.sum(dim=1).to(x.dtype)


def fp8_moe_config(t: int, num_experts: int, top_k: int, group: int, device: torch.device):
    """kernels/fused_moe_config.py's heuristic tiles with the K step set to the activation
    group (one scale per row and step); small tiles in the interpreter."""
    from kernels.fused_moe_config import GemmTile, MoEConfig, heuristic

    if device.type != "cuda":
        tile = GemmTile(16, 32, group, 1, 4, 1)
        return MoEConfig(tile, tile)
    cfg = heuristic(t, num_experts, top_k)
    return MoEConfig(dataclasses.replace(cfg.gate_up, block_k=group), dataclasses.replace(cfg.down, block_k=group))


def fused_moe_fp8(x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, expert_map: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None, config=None) -> torch.Tensor:
    """Triton W8A8 fused MoE (see the module note); returns out [T, H] in x's dtype."""
    _check(x, w13, w2, topk_weights, topk_ids, expert_map)
    group = act_group(w13)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    if config is None:
        num_experts = expert_map.numel() if expert_map is not None else w13.q.shape[0]
        config = fp8_moe_config(x.shape[0], num_experts, topk_ids.shape[1], group, x.device)
    if config.gate_up.block_k != group or config.down.block_k != group:
        raise ValueError(f"the GEMMs' K step must be the activation group ({group})")
    from kernels.triton_fp8_moe import launch_fused_moe_fp8
    return launch_fused_moe_fp8(x, w13, w2, topk_weights.float(), topk_ids, expert_map, out, config, group)


def fp8_decode_tile(tile: DecodeTile, group_k: int) -> DecodeTile:
    """The experts kernel's K tiles as given where each lies inside one scale group or spans
    whole groups (the kernel sums those group by group), else narrowed until one divides the
    group. (Narrowing every tile to the group would leave a program too few bytes in flight at
    one token: Qwen3-30B-A3B's gate/up tiles 4 KB, its down tiles 2 KB of FP8.)"""
    def fit(k):
        if k % group_k == 0 and (k // group_k) & (k // group_k - 1) == 0:
            return k
        while group_k % k:
            k //= 2
        return k
    return dataclasses.replace(tile, gate_up_block_k=fit(tile.gate_up_block_k),
                               down_block_k=fit(tile.down_block_k))


def experts_fp8(x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, weights: torch.Tensor, ids: torch.Tensor, *,
                counters: DecodeCounters, expert_map: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None, tile: DecodeTile = DecodeTile(), pdl=None) -> torch.Tensor:
    """kernels.moe_decode.experts over FP8 weights (one launch: experts and the top-k sum)."""
    _check(x, w13, w2, weights, ids, expert_map)
    _check_counters(counters, x.shape[0], ids.shape[1])
    if w2.q.shape[2] > counters.intermediate:
        raise ValueError(f"counters are sized for an expert intermediate of {counters.intermediate}, "
                         f"got {w2.q.shape[2]}")
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    from kernels.triton_moe_decode import launch_experts
    return launch_experts(x if x.stride(1) == 1 else x.contiguous(), w13.q, w2.q, weights.float().contiguous(),
                          ids.to(torch.int32).contiguous(), expert_map, out, counters.down,
                          fp8_decode_tile(tile, w13.group_k), pdl, fp8=(w13, w2))
