"""Building blocks shared by the Llama-family models, tensor-parallel aware.

Each parallel layer knows how to take its shard out of a full checkpoint tensor
(`load_full`), so the loader stays generic. The column- and row-parallel linears can hold
FP8 weights (quantization/fp8_params.py): `fp8_layouts` says where their shard of an FP8
checkpoint tensor comes from, and their forward then runs kernels/fp8_linear.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import FP8_DTYPE

from ..parallel.context import TPContext
from ..quantization.fp8_params import Fp8Layout, RowSlice, fp8_weight


def _linear(module, x, weight, bias=None, x_fp8=None):
    """F.linear, or at decode sizes (<= 16 rows, 16-bit, GPU) the split-K small-batch kernel
    when the engine enabled it on this layer (module.small_batch: its workspace; module.pdl:
    programmatic dependent launch, kernels/pdl.py). FP8 weights: kernels/fp8_linear.py (x_fp8:
    x's rows already quantized by the norm before, kernels/fp8.py Fp8Rows)."""
    ws = module.small_batch
    if weight.dtype == FP8_DTYPE:
        from kernels.fp8_linear import fp8_linear
        return fp8_linear(x, fp8_weight(module), bias, workspace=ws, pdl=module.pdl, x_fp8=x_fp8)
    if ws is not None and x.dim() == 2:
        from kernels.small_batch_linear import small_batch_linear, small_batch_preferred, small_batch_tuned
        if small_batch_preferred(x.shape[0], weight.shape[0], weight.shape[1], x.dtype) and (
                not ws.tuned_only or small_batch_tuned(x, weight)):
            return small_batch_linear(x, weight, bias, workspace=ws, pdl=module.pdl)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm arithmetic exactly (normalise in float32, cast back, then scale).
    fused=True (GPU): one Triton kernel for the residual add and the norm."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused = fused
        self.pdl = None  # kernels.pdl.Pdl: launch the fused kernel with PDL (set by the engine)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            from kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, pdl=self.pdl)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def forward_fp8_rows(self, x: torch.Tensor, residual: torch.Tensor | None, group: int | None):
        """(normed, new residual or None, kernels.fp8.Fp8Rows or None). With a group (the one the
        FP8 linear after this norm would quantize by: its fp8_rows_group) the fused kernel also
        writes the normed rows in FP8, and that linear skips its own quantization."""
        if group is None or not self.fused:
            res = self.forward(x, residual)
            return (res, None, None) if residual is None else (*res, None)
        from kernels.rms_norm import rms_norm_fp8_rows
        return rms_norm_fp8_rows(x, self.weight, self.eps, residual, group, pdl=self.pdl)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks. `parts` lists the sizes of
    stacked sub-matrices (e.g. q, k, v) so each is split separately."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TPContext, dtype,
                 shards: list[tuple[int, int]] | None = None):
        """shards: this rank's (first row, rows) of each full part; default the even split.
        Replicated KV heads give several ranks the same rows."""
        super().__init__()
        self.tp = tp
        if shards is None:
            shards = [(tp.rank * n, n) for n in (tp.shard(p, "output features") for p in parts)]
        self.starts = [start for start, _ in shards]
        self.parts = [n for _, n in shards]
        out = sum(self.parts)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.small_batch = None  # SmallBatchWorkspace when the engine routes decode sizes to Triton
        self.pdl = None  # kernels.pdl.Pdl for the small-batch kernel (set by the engine)
        self.fp8 = None  # {"weight": Fp8Layout} once the weight is FP8
        self.lora = None  # LoraLinear (shared/engine/lora/layer.py) when the engine serves adapters

    def forward(self, x, x_fp8=None):
        y = _linear(self, x, self.weight, self.bias, x_fp8)
        return y if self.lora is None else self.lora.add(x, y)

    def fp8_rows_group(self, x: torch.Tensor, gate_up: bool = False) -> int | None:
        """The group by which the norm before this layer should also write x in FP8 for it
        (kernels/fp8_linear.py fp8_rows_group), or None (16-bit weights, a route that does not
        quantize x that way). x: the norm's input rows."""
        if not self.fp8:
            return None
        from kernels.fp8_linear import fp8_rows_group
        return fp8_rows_group(x, fp8_weight(self), self.small_batch, gate_up)

    def fp8_layouts(self, grid) -> dict[str, Fp8Layout]:
        """Each stacked part's rows of its own checkpoint tensor, every column."""
        parts = tuple(RowSlice(s, n) for s, n in zip(self.starts, self.parts))
        return {"weight": Fp8Layout(parts, 0, self.weight.shape[1], 0, grid)}

    def fp8_slot(self, part):
        return "weight", part, None

    def forward_parts(self, x, x_fp8=None) -> list[torch.Tensor]:
        """The stacked outputs separately. On GPU one matmul then views; on CPU one matmul
        per part, which is faster there at small batch (smaller weight working set)."""
        if x.device.type == "cuda" or len(self.parts) == 1 or self.fp8:
            return list(self.forward(x, x_fp8).split(self.parts, dim=-1))
        outs, start = [], 0
        for n in self.parts:
            b = None if self.bias is None else self.bias[start:start + n]
            outs.append(F.linear(x, self.weight[start:start + n], b))
            start += n
        return outs if self.lora is None else self.lora.add_parts(x, outs)

    def load_full(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        n = self.parts[part]
        shard = tensor.narrow(0, self.starts[part], n)
        start = sum(self.parts[:part])
        target = self.bias if is_bias else self.weight
        target.data.narrow(0, start, n).copy_(shard)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split; partial sums are all-reduced unless the
    caller fuses that reduction with what follows (reduce=False)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, dtype, reduce: bool = True):
        super().__init__()
        self.tp = tp
        self.in_shard = tp.shard(in_features, "input features")
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard, dtype=dtype), requires_grad=False)
        self.small_batch = None
        self.pdl = None
        self.fp8 = None
        self.lora = None  # LoraLinear: its update is a partial sum too, reduced with the output

    def forward(self, x):
        y = _linear(self, x, self.weight)
        if self.lora is not None:
            y = self.lora.add(x, y)
        return self.tp.all_reduce(y) if self.reduce else y

    def fp8_layouts(self, grid) -> dict[str, Fp8Layout]:
        """Every row, this rank's input columns."""
        rows = self.weight.shape[0]
        stride = self.in_shard if self.tp.size > 1 else 0
        return {"weight": Fp8Layout((RowSlice(0, rows),), self.tp.rank * self.in_shard, self.in_shard, 0, grid,
                                    stride)}

    def fp8_slot(self, part):
        return "weight", 0, None

    def load_full(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        self.weight.data.copy_(tensor.narrow(1, self.tp.rank * self.in_shard, self.in_shard))


class SwiGLU(nn.Module):
    """The dense SwiGLU MLP (Llama/Qwen `mlp`, and Qwen2-MoE's shared expert). Returns partial
    sums: the down projection is row-parallel and the caller fuses the reduction with what
    follows (see reduce_add_norm)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype, fused: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=False, tp=tp,
                                                 dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, dtype, reduce=False)
        self.inter = tp.shard(intermediate, "intermediate_size")
        self.fused = fused

    def fp8_rows_group(self, h: torch.Tensor) -> int | None:
        """ColumnParallelLinear.fp8_rows_group for the fused gate/up launch."""
        return self.gate_up_proj.fp8_rows_group(h, gate_up=True)

    def forward(self, h, h_fp8=None):
        """h_fp8: h's rows already in FP8 (kernels/fp8.py Fp8Rows), for an FP8 gate/up."""
        ws = self.gate_up_proj.small_batch
        lora = self.gate_up_proj.lora
        fused_ok = lora is None or not lora.step.active  # the fused gate/up + SwiGLU kernels add no LoRA update
        if fused_ok and self.gate_up_proj.fp8:
            from kernels.fp8_linear import fp8_gate_up_silu
            out = fp8_gate_up_silu(h, fp8_weight(self.gate_up_proj), workspace=ws, pdl=self.gate_up_proj.pdl,
                                   x_fp8=h_fp8)
            if out is not None:
                return self.down_proj(out)
        elif fused_ok and ws is not None and h.dim() == 2:
            from kernels.small_batch_linear import small_batch_gate_up_silu, small_batch_preferred, small_batch_tuned
            w = self.gate_up_proj.weight
            if small_batch_preferred(h.shape[0], w.shape[0], w.shape[1], h.dtype) and (
                    not ws.tuned_only or small_batch_tuned(h, w, gate_up=True)):
                return self.down_proj(small_batch_gate_up_silu(h, w, workspace=ws, pdl=self.gate_up_proj.pdl))
        gate_up = self.gate_up_proj(h)
        if self.fused:
            from kernels.silu_and_mul import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its own range and the
    partial (zero elsewhere) results are all-reduced."""

    def __init__(self, vocab: int, dim: int, tp: TPContext, dtype):
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.per_rank = (vocab + tp.size - 1) // tp.size
        self.start = tp.rank * self.per_rank
        self.end = min(vocab, self.start + self.per_rank)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def load_full(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        rows = self.end - self.start
        self.weight.data[:rows].copy_(tensor[self.start:self.end])


class ParallelLMHead(nn.Module):
    """Logits for the vocabulary, each rank computing its slice, gathered on every rank."""

    def __init__(self, embedding: VocabParallelEmbedding | None, vocab: int, dim: int, tp: TPContext, dtype):
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        if embedding is not None:  # tied: share the embedding's shard
            self.weight = embedding.weight
            self.start, self.end = embedding.start, embedding.end
        else:
            per = (vocab + tp.size - 1) // tp.size
            self.start = tp.rank * per
            self.end = min(vocab, self.start + per)
            self.weight = nn.Parameter(torch.zeros(per, dim, dtype=dtype), requires_grad=False)
        self.small_batch = None
        self.pdl = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = _linear(self, h, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab]

    def load_full(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        self.weight.data[: self.end - self.start].copy_(tensor[self.start:self.end])


def enable_small_batch_linears(model: nn.Module, workspace, mode: str = "all") -> int:
    """Route the model's linears (qkv, o, gate/up + SwiGLU, down, LM head) to the small-batch
    kernel at decode sizes. mode "all": every one; "lm_head": the LM head alone; "auto": the LM
    head, and the others where this GPU's sweep tuned their shape and batch bucket (there it
    beat cuBLAS). One workspace's buffers for all (they run one after another on one stream).
    Returns how many layers were switched."""
    import dataclasses
    tuned = dataclasses.replace(workspace, tuned_only=True)
    n = 0
    for m in model.modules():
        if isinstance(m, ParallelLMHead):
            m.small_batch = workspace
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and mode != "lm_head":
            m.small_batch = tuned if mode == "auto" else workspace
        else:
            continue
        n += 1
    return n


def enable_pdl(model: nn.Module, pdl, prefetch_at: dict[str, int] | None = None) -> int:
    """Launch the model's decode-path Triton kernels (fused norms, q/k-norm + RoPE, the
    small-batch linears, the MoE decode kernels) with programmatic dependent launch
    (kernels/pdl.py). prefetch_at: prefetch depths for the linears of those attribute names
    (e.g. {"o_proj": 8}) in place of pdl's. Returns how many modules were switched."""
    import dataclasses
    prefetch_at = prefetch_at or {}
    n = 0
    for name, m in model.named_modules():
        if hasattr(m, "pdl"):
            depth = prefetch_at.get(name.rsplit(".", 1)[-1])
            m.pdl = pdl if depth is None else dataclasses.replace(pdl, prefetch_k_blocks=depth)
            n += 1
    return n


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position, computed exactly as HF does (float32, then cast).

    The inverse frequencies come from transformers' own rope-init functions, so every
    rope scaling the config names (linear, llama3, yarn, ...) matches HF."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype, device, fused: bool = False):
        super().__init__()
        self.fused = fused
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise ValueError(f"rope scaling type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype).to(device), persistent=False)
        half = head_dim // 2
        # the fused kernel's table: cos of the first half, then sin of the first half
        self.register_buffer("cos_sin", torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated q, k (in place when fused)."""
        if self.fused:
            from kernels.rotary_embedding import rotary_embedding
            return rotary_embedding(positions, q, k, self.cos_sin, is_neox=True)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
