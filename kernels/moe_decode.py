"""A decode batch's whole MoE block (router, top-k, experts, top-k sum) in three launches.

At decode sizes (a few tokens) the grouped-GEMM path (kernels/fused_moe.py) is seven
launches: a router GEMM, the top-k, the single-program expert sort, two GEMMs and the top-k
sum, each a short kernel whose ramp, DRAM latency and tail weigh against a layer's expert
bytes (Qwen3-30B-A3B at one token: eight experts, 75 MB in bf16). Here two:
  1. route: router logits and top-k; programs over (token, block of experts), the last
     to finish a token routes it;
  2. experts: gate/up with SiLU-and-mul per (pair, column block), no sort or padding, and
     in the same grid down per (pair, column block): it prefetches its weights, waits for
     its pair's gate/up, applies the routing weight; the last to finish a (token, column
     block) sums the token's rows in slot order.
The result equals kernels.fused_moe's path (same rounding points: router logits in the
router's dtype, gate/up and the intermediate and each expert's output in x's dtype).

    out[t] = sum_j w[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
    (w, ids) = top-k of softmax(x[t] @ router_w^T), e = expert_map[ids[t, j]]

`counters` is an int32 buffer of at least counters_needed(...) zeros that the kernels leave
zeroed (so a CUDA graph can keep it); None allocates one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.fused_moe import _check, fused_moe_reference, select_experts_reference


@dataclass(frozen=True)
class DecodeTile:
    """Defaults: a tile sweep of the Qwen3-30B-A3B shape at 1-4 tokens, the gate/up tile checked in
    the engine's decode step; the router ranks its experts by one sort on one warp, which needs
    no shared-memory barrier where k rounds of max + argmax across warps need two each
    (docs/performance/kernels.md)."""
    router_block_e: int = 2
    router_block_k: int = 2048
    router_warps: int = 1  # the sort on one warp: no barrier between warps
    router_sort: bool = True  # top-k by one sort of packed (probability, index) keys, not k argmax rounds
    gate_up_block_n: int = 32
    gate_up_block_k: int = 256  # a gate/up program's K chunk (partial sums added by the last)
    down_block_n: int = 16
    down_block_k: int = 256  # the down tile's width along I (its first tile loads before the wait)
    warps: int = 2  # of the experts kernel (as fast as 4 at one token, faster at two)


def moe_decode_reference(x, router_w, w13, w2, top_k: int, renormalize: bool, round_weights_to=None,
                         expert_map: Optional[torch.Tensor] = None):
    """Torch: the router linear rounded to its dtype, HF's top-k, then fused_moe_reference.
    Returns (out, weights, ids)."""
    logits = (x.to(torch.float64) @ router_w.to(torch.float64).T).to(router_w.dtype)
    weights, ids = select_experts_reference(logits, top_k, renormalize)
    if round_weights_to is not None:
        weights = weights.to(round_weights_to).float()
    return fused_moe_reference(x, w13, w2, weights, ids, expert_map=expert_map), weights, ids


@dataclass
class DecodeCounters:
    """Arrival counters for one MoE block's decode kernels, sized for up to max_tokens; the
    kernels leave them zeroed, so one pair serves every call and every CUDA graph."""
    router: torch.Tensor
    down: torch.Tensor
    max_tokens: int
    top_k: int
    intermediate: int

    @classmethod
    def create(cls, max_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
               tile: DecodeTile, device=None):
        from kernels.triton_moe_decode import down_counters, router_counters
        z = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        return cls(z(router_counters(max_tokens, num_experts, tile)),
                   z(down_counters(max_tokens, top_k, hidden, intermediate, tile)), max_tokens, top_k, intermediate)


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, renormalize: bool, round_weights_to=None, *,
          counters: DecodeCounters, tile: DecodeTile = DecodeTile(), pdl=None):
    """Router logits and top-k in one launch: (weights float32 [T, k], ids int32 [T, k]).
    pdl: a kernels.pdl.Pdl to launch with programmatic dependent launch (Hopper+)."""
    if router_w.dim() != 2 or router_w.shape[1] != x.shape[-1]:
        raise ValueError(f"router_w must be [E, H] with H = {x.shape[-1]}, got {tuple(router_w.shape)}")
    if not 0 < top_k <= router_w.shape[0]:
        raise ValueError(f"need 0 < top_k <= E, got top_k={top_k}, E={router_w.shape[0]}")
    _check_counters(counters, x.shape[0], top_k)
    if x.shape[0] == 0:
        return (torch.empty(0, top_k, dtype=torch.float32, device=x.device),
                torch.empty(0, top_k, dtype=torch.int32, device=x.device))
    from kernels.triton_moe_decode import launch_route
    return launch_route(x if x.stride(1) == 1 else x.contiguous(), router_w, top_k, renormalize, round_weights_to,
                        counters.router, tile, pdl)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
            counters: DecodeCounters, expert_map: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
            tile: DecodeTile = DecodeTile(), pdl=None) -> torch.Tensor:
    """The experts and the top-k sum in one launch (programs per pair and column block).
    pdl: a kernels.pdl.Pdl to launch with programmatic dependent launch (Hopper+)."""
    _check(x, w13, w2, weights, ids, expert_map)
    _check_counters(counters, x.shape[0], ids.shape[1])
    if w2.shape[2] > counters.intermediate:
        raise ValueError(f"counters are sized for an expert intermediate of {counters.intermediate}, "
                         f"got {w2.shape[2]}")
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    from kernels.triton_moe_decode import launch_experts
    return launch_experts(x if x.stride(1) == 1 else x.contiguous(), w13, w2, weights.float().contiguous(),
                          ids.to(torch.int32).contiguous(), expert_map, out, counters.down, tile, pdl)


def moe_decode(x: torch.Tensor, router_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool, round_weights_to=None, *, expert_map: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, counters: Optional[DecodeCounters] = None,
               tile: DecodeTile = DecodeTile(), pdl=None):
    """route then experts: the whole block in two launches. Returns (out, weights, ids)."""
    if expert_map is None and w13.shape[0] != router_w.shape[0]:
        raise ValueError(f"w13 holds {w13.shape[0]} experts, the router {router_w.shape[0]}: pass an expert_map")
    if counters is None:
        counters = DecodeCounters.create(max(1, x.shape[0]), router_w.shape[0], top_k, x.shape[-1], w2.shape[2],
                                          tile, x.device)
    weights, ids = route(x, router_w, top_k, renormalize, round_weights_to, counters=counters, tile=tile, pdl=pdl)
    return experts(x, w13, w2, weights, ids, counters=counters, expert_map=expert_map, out=out, tile=tile,
                   pdl=pdl), \
        weights, ids


def _check_counters(counters: DecodeCounters, tokens: int, top_k: int) -> None:
    if tokens > counters.max_tokens or top_k > counters.top_k:
        raise ValueError(f"counters are sized for {counters.max_tokens} tokens x top-{counters.top_k}, "
                         f"got {tokens} x top-{top_k}")
