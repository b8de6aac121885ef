"""Llama-family decoder (Llama, Mistral-style, Qwen2, Qwen3, and their mixture-of-experts
siblings Qwen2-MoE, Qwen3-MoE, Mixtral) over paged KV.

One class covers them all; they differ only in q/k/v bias (Qwen2), per-head RMSNorm on q
and k before rotary (Qwen3), the head_dim/rope settings in the config, and whether a
layer's MLP is dense or an MoE block (models/moe.py) with the same interface."""
from __future__ import annotations

import torch
from torch import nn

from ..model_config import ModelConfig
from ..parallel.context import TPContext
from .layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding,
                     RowParallelLinear, SwiGLU, VocabParallelEmbedding)
from .moe import MoEBlock


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext, dtype, fused: bool = False):
        super().__init__()
        self.layer_id = layer_id
        kv = tp.kv_heads(cfg.num_kv_heads)  # replicated when TP exceeds the KV heads
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = kv.count
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
            bias=cfg.attention_bias, tp=tp, dtype=dtype,
            shards=[(tp.rank * self.num_heads * d, self.num_heads * d), (kv.first * d, kv.count * d),
                    (kv.first * d, kv.count * d)])
        # partial sums: the next norm all-reduces them (fused with the residual add on GPU)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, dtype, reduce=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, fused) if cfg.qk_norm else None
        self.scaling = d ** -0.5
        # an FP8 KV cache's dequantization scales, from the checkpoint's k_scale / v_scale
        # (1.0 without them); the pool holds and applies them (kv_pool.py)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.fused = fused
        self.pdl = None  # kernels.pdl.Pdl for the fused q/k-norm + RoPE kernel (set by the engine)

    def forward(self, positions, h, rotary: RotaryEmbedding, fb, h_fp8=None):
        """h_fp8: h's rows already in FP8 for an FP8 qkv (kernels/fp8.py Fp8Rows), or None."""
        q, k, v = self.qkv_proj.forward_parts(h, h_fp8)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused:
            return self._forward_fused(positions, q, k, v, rotary, fb)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.layer_id, fb.attn, self.scaling)
        return self.o_proj(o.reshape(-1, self.q_size))

    def _forward_fused(self, positions, q, k, v, rotary: RotaryEmbedding, fb):
        """GPU: one kernel normalises (Qwen3) and rotates q and k in place in the qkv output
        and writes k and v into this layer's cache; the backend then only attends. Saves the
        norm/rotary/store launches and the copies that norming strided q/k views costs."""
        from kernels.qk_norm_rope import KVCacheWrite, QKNorm, qk_norm_rope

        backend, meta = fb.attn_backend, fb.attn
        k_cache, v_cache = backend.kv_cache(self.layer_id)
        norm = None
        if self.q_norm is not None:
            norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        k_scale, v_scale = backend.kv_scales(self.layer_id)
        qk_norm_rope(positions, q, k, rotary.cos_sin, is_neox=True, norm=norm,
                     kv_write=KVCacheWrite(k_cache, v_cache, v, meta.slot_mapping, k_scale, v_scale), pdl=self.pdl)
        o = backend.forward(q, k, v, self.layer_id, meta, self.scaling, kv_stored=True)
        return self.o_proj(o.reshape(-1, self.q_size))


def reduce_add_norm(tp: TPContext, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                    fp8_group: int | None = None):
    """All-reduce a row-parallel output, add the residual, RMSNorm: (normed, new residual,
    the normed rows in FP8 or None). With TP on GPU one custom kernel does all three
    (custom_all_reduce.py; it writes no FP8 rows). fp8_group: the next FP8 linear's
    fp8_rows_group, for the norm's kernel to quantize its output by."""
    if tp.size > 1:
        fused = tp.custom_all_reduce
        if fused is not None:
            out = fused.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
            if out is not None:
                return (*out, None)
        x = tp.all_reduce(x)
    return norm.forward_fp8_rows(x, residual, fp8_group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext, dtype, fused: bool = False,
                 expert_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, layer_id, tp, dtype, fused)
        if cfg.moe is not None and cfg.moe.is_sparse(layer_id):
            self.mlp = MoEBlock(cfg.moe, cfg.hidden_size, tp, dtype, fused, expert_parallel)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp, dtype, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, fused)

    def forward(self, positions, h, residual, rotary, fb):
        """h: the embedding (residual None) or the previous layer's un-reduced MLP output.
        Returns this layer's un-reduced MLP output and the residual stream. Where the next
        linear is FP8 at decode sizes, each norm also hands it the rows in FP8 (h8)."""
        group = self.self_attn.qkv_proj.fp8_rows_group(h)
        if residual is None:
            residual = h
            h, _, h8 = self.input_layernorm.forward_fp8_rows(h, None, group)
        else:
            h, residual, h8 = reduce_add_norm(self.tp, h, residual, self.input_layernorm, group)
        h = self.self_attn(positions, h, rotary, fb, h8)
        dense = isinstance(self.mlp, SwiGLU)
        group = self.mlp.fp8_rows_group(h) if dense else None
        h, residual, h8 = reduce_add_norm(self.tp, h, residual, self.post_attention_layernorm, group)
        return (self.mlp(h, h8) if dense else self.mlp(h)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, device, max_positions: int,
                 fused: bool = False, expert_parallel: bool = False):
        """fused: use the Triton kernels (fused add+RMSNorm, q/k norm + rotary + KV store,
        silu_and_mul, fused MoE); GPU only. expert_parallel: MoE experts split whole across
        the tensor-parallel ranks instead of sliced (models/moe.py)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, dtype, fused, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, fused)
        self.lm_head = ParallelLMHead(self.embed_tokens if cfg.tie_word_embeddings else None,
                                      cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions, dtype, device, fused)
        # EAGLE-3 speculation: records the residual stream at a few layer inputs
        # (speculative/eagle3.AuxHiddenCapture); None otherwise
        self.aux_capture = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        h = self.embed_tokens(input_ids)
        residual = None
        aux = self.aux_capture
        for i, layer in enumerate(self.layers):
            if aux is not None:
                aux.capture(i, h, residual)
            h, residual = layer(positions, h, residual, self.rotary, fb)
        if aux is not None:
            aux.capture(len(self.layers), h, residual)
        h, _, _ = reduce_add_norm(self.tp, h, residual, self.norm)
        return h

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def param_for(self, hf_name: str):
        """Map a checkpoint tensor name to (module, part index, is_bias), or None to skip."""
        name = hf_name.removeprefix("model.")
        if name.startswith("lm_head."):
            return (None if self.cfg.tie_word_embeddings else (self.lm_head, 0, False))
        if name == "embed_tokens.weight":
            return self.embed_tokens, 0, False
        if name == "norm.weight":
            return self.norm, 0, False
        if not name.startswith("layers."):
            return None
        _, idx, rest = name.split(".", 2)
        layer = self.layers[int(idx)]
        is_bias = rest.endswith(".bias")
        if isinstance(layer.mlp, MoEBlock):
            target = _moe_param(layer.mlp, rest, self.cfg.moe.checkpoint_block)
            if target is not None:
                return target
        stacked = {"self_attn.q_proj": (layer.self_attn.qkv_proj, 0),
                   "self_attn.k_proj": (layer.self_attn.qkv_proj, 1),
                   "self_attn.v_proj": (layer.self_attn.qkv_proj, 2),
                   "self_attn.o_proj": (layer.self_attn.o_proj, 0)}
        if isinstance(layer.mlp, SwiGLU):
            stacked.update({"mlp.gate_proj": (layer.mlp.gate_up_proj, 0),
                            "mlp.up_proj": (layer.mlp.gate_up_proj, 1),
                            "mlp.down_proj": (layer.mlp.down_proj, 0)})
        prefix = rest.rsplit(".", 1)[0]
        if prefix in stacked:
            mod, part = stacked[prefix]
            return mod, part, is_bias
        plain = {"input_layernorm": layer.input_layernorm,
                 "post_attention_layernorm": layer.post_attention_layernorm,
                 "self_attn.q_norm": layer.self_attn.q_norm,
                 "self_attn.k_norm": layer.self_attn.k_norm}
        if prefix in plain and plain[prefix] is not None:
            return plain[prefix], 0, False
        if "rotary_emb" in rest:
            return None
        raise KeyError(f"unexpected checkpoint tensor {hf_name}")


# per-expert checkpoint names: Qwen's gate/up/down_proj, Mixtral's w1 (gate) / w3 (up) / w2 (down)
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
                 "w2": "down"}


def _moe_param(block: MoEBlock, rest: str, block_name: str):
    """(module, part, is_bias) for a tensor of an MoE block, or None if it is not one.
    rest: the name after `layers.<i>.`, e.g. `mlp.experts.3.gate_proj.weight`,
    `block_sparse_moe.gate.weight`, or transformers v5's stacked `mlp.experts.gate_up_proj`."""
    if not rest.startswith(block_name + "."):
        return None
    name = rest[len(block_name) + 1:]
    if name == "gate.weight":
        return block.gate, 0, False
    if name.startswith("experts."):
        parts = name.split(".")
        if len(parts) == 2 and parts[1] in ("gate_up_proj", "down_proj"):  # stacked [E, ...]
            return block.experts, (parts[1].removesuffix("_proj"), None), False
        if len(parts) == 4 and parts[1].isdigit() and parts[2] in _EXPERT_PARTS and parts[3] == "weight":
            return block.experts, (_EXPERT_PARTS[parts[2]], int(parts[1])), False
    if block.shared_expert is not None:
        shared = {"shared_expert.gate_proj.weight": (block.shared_expert.gate_up_proj, 0),
                  "shared_expert.up_proj.weight": (block.shared_expert.gate_up_proj, 1),
                  "shared_expert.down_proj.weight": (block.shared_expert.down_proj, 0),
                  "shared_expert_gate.weight": (block.shared_expert_gate, 0)}
        if name in shared:
            mod, part = shared[name]
            return mod, part, False
    return None
