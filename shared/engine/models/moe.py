"""The mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral), tensor/expert parallel.

A block is a router (replicated linear to E logits; softmax in float32, top-k, optional
renormalisation), E SwiGLU experts and, for Qwen2-MoE, a shared expert scaled by a sigmoid
gate. Like the dense MLP it returns un-reduced partial sums: the decoder layer's next
all-reduce (fused with the residual add and RMSNorm on GPU) combines the ranks.

How experts are split over ranks (`ExpertPlacement`):
- tensor parallel (default, SGLang's): every rank holds every expert, a 1/tp slice of each
  expert's intermediate dimension; its partial sums add up across ranks.
- expert parallel (`--ep N` with `--tp N`): rank r holds experts [r*E/N, (r+1)*E/N) whole.
  Attention is tensor parallel, so after its all-reduce every rank holds every token: the
  dispatch is already done, each rank runs the tokens routed to its own experts (the
  others contribute zero), and the combine is the same all-reduce the dense path uses
  (reduce-scatter + all-gather in one). An all-to-all would move top_k times more bytes
  here; it pays off only when attention is data parallel (each rank its own tokens).

GPU: kernels/fused_moe.py (expert-aligned grouped GEMMs, SiLU-and-mul fused, CUDA-graph
safe) for prefill; at decode sizes kernels/moe_decode.py: the router GEMV and top-k in one
launch (up to ROUTE_FUSED_MAX_TOKENS tokens) and, for the fewest tokens
(EXPERTS_DECODE_MAX_TOKENS; _FP8 for FP8 experts), the experts as per-pair GEMVs with the top-k sum fused: three
launches for the block instead of seven. CPU: a loop over the experts the batch touches, in transformers' order of
operations, so float64 runs match it token for token.

FP8 experts (quantization/fp8_params.py): w13 and w2 in float8_e4m3fn with block or
per-channel scales; the GPU paths run kernels/fp8_moe.py (W8A8 grouped GEMMs, the W8A16
per-pair decode kernel), the CPU loop dequantizes them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_decode import DecodeCounters, DecodeTile

from ..moe_config import MoEConfig
from ..parallel.context import TPContext
from ..quantization.fp8_params import Fp8Layout, RowSlice, fp8_weight
from .layers import SwiGLU


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts, and which slice of their intermediate dimension, this rank holds."""
    num_experts: int
    first_expert: int
    num_local_experts: int
    intermediate_size: int  # of one expert, whole
    inter_start: int  # this rank's slice of it
    inter_local: int

    @classmethod
    def for_rank(cls, moe: MoEConfig, tp: TPContext, expert_parallel: bool) -> "ExpertPlacement":
        i = moe.intermediate_size
        if expert_parallel and tp.size > 1:
            local = tp.shard(moe.num_experts, "num_experts (expert parallel)")
            return cls(moe.num_experts, tp.rank * local, local, i, 0, i)
        inter = tp.shard(i, "moe_intermediate_size")
        return cls(moe.num_experts, 0, moe.num_experts, i, tp.rank * inter, inter)

    @property
    def is_expert_parallel(self) -> bool:
        return self.num_local_experts < self.num_experts

    def local_index(self, expert: int) -> int | None:
        e = expert - self.first_expert
        return e if 0 <= e < self.num_local_experts else None

    def expert_map(self) -> torch.Tensor:
        """int32 [E]: global expert id -> local index, -1 where another rank holds it."""
        m = torch.full((self.num_experts,), -1, dtype=torch.int32)
        m[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
            self.num_local_experts, dtype=torch.int32)
        return m


class ExpertWeights(nn.Module):
    """The experts' weights stacked in the layout the fused kernel reads: w13
    [E_local, 2*I_local, H] (gate rows, then up rows; K-major) and w2 [E_local, H, I_local].
    Loaded from per-expert checkpoint tensors (the hub layout) or from stacked ones."""

    def __init__(self, hidden: int, place: ExpertPlacement, dtype):
        super().__init__()
        self.place = place
        e, i = place.num_local_experts, place.inter_local
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden, i, dtype=dtype), requires_grad=False)
        self._loaded: set[tuple[str, int]] = set()
        self.fp8 = None  # {"w13": Fp8Layout, "w2": Fp8Layout} once the experts are FP8

    # which stacked weight, part and local expert a per-expert checkpoint tensor fills
    _SLOTS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}

    def fp8_layouts(self, grid) -> dict[str, Fp8Layout]:
        """gate and up: this rank's slice of each expert's intermediate rows; down: every
        row, the same slice of its input columns."""
        p, h = self.place, self.w13.shape[2]
        inter = RowSlice(p.inter_start, p.inter_local)
        stride = p.inter_local if p.inter_local < p.intermediate_size else 0  # sliced over the ranks
        return {"w13": Fp8Layout((inter, inter), 0, h, p.num_local_experts, grid),
                "w2": Fp8Layout((RowSlice(0, h),), p.inter_start, p.inter_local, p.num_local_experts, grid, stride)}

    def fp8_slot(self, part):
        """(attr, part, local expert) for a per-expert tensor; local None: another rank's."""
        which, expert = part
        if expert is None:
            raise KeyError("FP8 experts stacked in one checkpoint tensor are not supported; "
                           "per-expert tensors (experts.<e>.gate_proj.weight ...) are")
        attr, index = self._SLOTS[which]
        return attr, index, self.place.local_index(expert)

    def mark(self, which: str, local: int) -> None:
        self._loaded.add((which, local))

    def load_full(self, tensor: torch.Tensor, part, is_bias: bool = False) -> None:
        """part: (which, expert) with which in gate | up | down for one expert's [out, in]
        tensor, or (gate_up | down, None) for all experts stacked ([E, 2I, H] / [E, H, I])."""
        which, expert = part
        if expert is None:
            for e in range(self.place.num_experts):
                if which == "gate_up":
                    i = self.place.intermediate_size
                    self.load_full(tensor[e, :i], ("gate", e))
                    self.load_full(tensor[e, i:], ("up", e))
                else:
                    self.load_full(tensor[e], ("down", e))
            return
        local = self.place.local_index(expert)
        if local is None:  # expert parallel: another rank's expert
            return
        s, n = self.place.inter_start, self.place.inter_local
        if which == "gate":
            self.w13.data[local, :n].copy_(tensor.narrow(0, s, n))
        elif which == "up":
            self.w13.data[local, n:].copy_(tensor.narrow(0, s, n))
        elif which == "down":
            self.w2.data[local].copy_(tensor.narrow(1, s, n))
        else:
            raise KeyError(f"unknown expert tensor kind {which!r}")
        self._loaded.add((which, local))

    def missing_weights(self) -> list[str]:
        """Expert tensors the checkpoint did not provide (checked after loading)."""
        out = []
        for local in range(self.place.num_local_experts):
            for which in ("gate", "up", "down"):
                if (which, local) not in self._loaded:
                    out.append(f"experts.{self.place.first_expert + local}.{which}")
        return out

    def mark_loaded(self) -> None:
        """Random weights (load_format dummy): nothing to check."""
        self._loaded = {(w, e) for e in range(self.place.num_local_experts) for w in ("gate", "up", "down")}


class ReplicatedLinear(nn.Module):
    """A linear every rank holds whole (the router, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


# token counts (decode batches) that take kernels/moe_decode.py's launches; above them the
# router is a GEMM and the experts the grouped GEMMs: a few launches beat seven while a layer's
# touched experts are few, the grouped GEMMs win once most experts are read anyway
# (docs/performance/kernels.md)
ROUTE_FUSED_MAX_TOKENS = 64
EXPERTS_DECODE_MAX_TOKENS = 2
# FP8 experts: the per-pair kernel reads FP8 weights without quantizing activations (W8A16), and
# the W8A8 grouped GEMMs' extra launch for that quantization keeps them behind to 4 tokens
EXPERTS_DECODE_MAX_TOKENS_FP8 = 4


class MoEBlock(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, tp: TPContext, dtype, fused: bool = False,
                 expert_parallel: bool = False):
        super().__init__()
        self.moe = moe
        self.place = ExpertPlacement.for_rank(moe, tp, expert_parallel)
        self.gate = ReplicatedLinear(hidden, moe.num_experts, dtype)  # the router
        self.experts = ExpertWeights(hidden, self.place, dtype)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(hidden, moe.shared_expert_intermediate_size, tp, dtype, fused)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype)
        self.fused = fused
        self.register_buffer("expert_map", self.place.expert_map(), persistent=False)
        # the decode kernels' arrival counters (zero; the kernels leave them zero): buffers, so
        # they exist on the weights' device before any CUDA graph is captured
        self.decode_tile = DecodeTile()
        self.pdl = None  # kernels.pdl.Pdl for the decode kernels (set by the engine)
        self._register_counters()

    def _register_counters(self, device=None) -> None:
        c = DecodeCounters.create(ROUTE_FUSED_MAX_TOKENS, self.moe.num_experts, self.moe.top_k,
                                  self.gate.weight.shape[1], self.place.inter_local,
                                  self.decode_tile, device)
        self.register_buffer("decode_router_counters", c.router, persistent=False)
        self.register_buffer("decode_down_counters", c.down, persistent=False)

    def init_buffers(self) -> None:
        """Recompute buffers after the module was made on the meta device (random weights)."""
        self.expert_map = self.place.expert_map().to(self.gate.weight.device)
        self._register_counters(self.gate.weight.device)
        self.experts.mark_loaded()

    def decode_counters(self) -> DecodeCounters:
        return DecodeCounters(self.decode_router_counters, self.decode_down_counters, ROUTE_FUSED_MAX_TOKENS,
                              self.moe.top_k, self.place.inter_local)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, H] -> this rank's partial sum of the block's output [T, H]."""
        if self.fused and 0 < h.shape[0] <= ROUTE_FUSED_MAX_TOKENS:
            out = self._forward_decode(h)
        elif self.fused:
            out = self._forward_fused(h, self.gate(h))
        else:
            out = self._forward_torch(h, self.gate(h))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's router: softmax in float32, top-k, optional renormalisation; the weights are
        then rounded to the activations' dtype where HF does so (Qwen)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def _forward_torch(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Loop over the local experts the batch touches (CPU; data-dependent shapes). FP8
        experts: the GPU kernels' reference (activations quantized where those quantize them)."""
        weights, ids = self._route(logits)
        if self.experts.fp8:
            from kernels.fp8_moe import fused_moe_fp8_reference
            emap = self.expert_map if self.place.is_expert_parallel else None
            return fused_moe_fp8_reference(h, fp8_weight(self.experts, "w13"), fp8_weight(self.experts, "w2"),
                                           weights.float(), ids.to(torch.int32), expert_map=emap,
                                           quantize_activations=h.shape[0] > EXPERTS_DECODE_MAX_TOKENS_FP8)
        out = torch.zeros_like(h)
        w13, w2, n = self.experts.w13, self.experts.w2, self.place.inter_local
        for expert in torch.unique(ids).tolist():
            local = self.place.local_index(expert)
            if local is None:
                continue
            tok, slot = torch.where(ids == expert)
            gate, up = F.linear(h[tok], w13[local]).split([n, n], dim=-1)
            y = F.linear(F.silu(gate) * up, w2[local]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _forward_decode(self, h: torch.Tensor) -> torch.Tensor:
        """A few tokens: router + top-k in one launch, then per-pair GEMVs (fewest tokens) or
        the grouped GEMMs."""
        from kernels import moe_decode
        from kernels.fused_moe import fused_moe

        counters = self.decode_counters()
        round_to = h.dtype if self.moe.weights_in_model_dtype else None
        weights, ids = moe_decode.route(h, self.gate.weight, self.moe.top_k, self.moe.norm_topk_prob, round_to,
                                        counters=counters, tile=self.decode_tile, pdl=self.pdl)
        emap = self.expert_map if self.place.is_expert_parallel else None
        if self.experts.fp8:
            from kernels.fp8_moe import experts_fp8, fused_moe_fp8
            w13, w2 = fp8_weight(self.experts, "w13"), fp8_weight(self.experts, "w2")
            if h.shape[0] <= EXPERTS_DECODE_MAX_TOKENS_FP8:
                return experts_fp8(h, w13, w2, weights, ids, counters=counters, expert_map=emap,
                                   tile=self.decode_tile, pdl=self.pdl)
            return fused_moe_fp8(h, w13, w2, weights, ids, expert_map=emap)
        if h.shape[0] <= EXPERTS_DECODE_MAX_TOKENS:
            return moe_decode.experts(h, self.experts.w13, self.experts.w2, weights, ids, counters=counters,
                                      expert_map=emap, tile=self.decode_tile, pdl=self.pdl)
        return fused_moe(h, self.experts.w13, self.experts.w2, weights, ids, expert_map=emap)

    def _forward_fused(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from kernels.fused_moe import fused_moe, select_experts

        # HF rounds the top-k weights to the activations' dtype (Qwen): the kernel does it
        weights, ids = select_experts(logits, self.moe.top_k, self.moe.norm_topk_prob,
                                      round_weights_to=h.dtype if self.moe.weights_in_model_dtype else None)
        emap = self.expert_map if self.place.is_expert_parallel else None
        if self.experts.fp8:
            from kernels.fp8_moe import fused_moe_fp8
            return fused_moe_fp8(h, fp8_weight(self.experts, "w13"), fp8_weight(self.experts, "w2"), weights, ids,
                                 expert_map=emap)
        return fused_moe(h, self.experts.w13, self.experts.w2, weights, ids, expert_map=emap)
