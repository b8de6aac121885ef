"""Which of the engine's linears a PEFT target module adapts, and the shapes its A and B must have.

The engine fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (models/llama.py),
so an adapter's q, k and v updates become the three stacked parts of one slot, each added into
its own columns. MoE layers adapt only attention: the experts' and shared expert's projections
are refused (the format has no per-expert slot layout here)."""
from __future__ import annotations

from dataclasses import dataclass

from ..model_config import ModelConfig


@dataclass(frozen=True)
class Target:
    block: str   # the decoder layer's submodule: self_attn | mlp
    linear: str  # the engine linear's attribute on it
    part: int    # which stacked part of that linear


# PEFT's module names (the checkpoint's) -> the engine's fused linears
TARGETS: dict[str, Target] = {
    "q_proj": Target("self_attn", "qkv_proj", 0), "k_proj": Target("self_attn", "qkv_proj", 1),
    "v_proj": Target("self_attn", "qkv_proj", 2), "o_proj": Target("self_attn", "o_proj", 0),
    "gate_proj": Target("mlp", "gate_up_proj", 0), "up_proj": Target("mlp", "gate_up_proj", 1),
    "down_proj": Target("mlp", "down_proj", 0),
}
# the engine linear -> its parts' PEFT names, in stacking order
LINEAR_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in features, out features) of a target module over the whole model (not a TP shard)."""
    d, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (hidden, cfg.num_heads * d), "k_proj": (hidden, cfg.num_kv_heads * d),
            "v_proj": (hidden, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


def dense_mlp(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer's MLP is the dense SwiGLU (LoRA-adaptable), not an MoE block."""
    return cfg.moe is None or not cfg.moe.is_sparse(layer)
