"""What a mixture-of-experts model's config says about its MoE layers.

Qwen3-MoE, Qwen2-MoE and Mixtral share one structure: a router (a linear to E logits,
softmax in float32, top-k, optionally renormalised) and E SwiGLU experts; Qwen2-MoE adds
one always-on shared expert scaled by a sigmoid gate. Qwen's configs can keep some layers
dense (`mlp_only_layers`, `decoder_sparse_step`)."""
from __future__ import annotations

from dataclasses import dataclass

# architectures whose configs route to experts but that we do not serve, with why
UNSUPPORTED_MOE = {
    "DeepseekV2ForCausalLM": "multi-head latent attention and grouped routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention and grouped sigmoid routing",
    "GptOssForCausalLM": "attention sinks, sliding windows and biased clamped-SwiGLU experts",
    "Qwen3NextForCausalLM": "hybrid linear attention",
    "Llama4ForConditionalGeneration": "chunked attention and sigmoid routing (multimodal)",
    "Llama4ForCausalLM": "chunked attention and sigmoid routing",
    "OlmoeForCausalLM": "not implemented",
    "PhimoeForCausalLM": "sparse-mixer routing",
    "GraniteMoeForCausalLM": "not implemented",
    "GraniteMoeSharedForCausalLM": "not implemented",
    "DbrxForCausalLM": "fused qkv layout and clipped attention",
    "JambaForCausalLM": "Mamba layers",
    "Glm4MoeForCausalLM": "grouped sigmoid routing",
    "Ernie4_5_MoeForCausalLM": "not implemented",
    "HunYuanMoEV1ForCausalLM": "not implemented",
    "MiniMaxForCausalLM": "lightning attention",
    "JetMoeForCausalLM": "mixture-of-attention heads",
    "Qwen3VLMoeForConditionalGeneration": "vision inputs",
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # HF casts the top-k weights to the activations' dtype before scaling the experts'
    # outputs (Qwen); Mixtral keeps them float32. Followed so float64 tests match exactly.
    weights_in_model_dtype: bool
    sparse_layers: tuple[int, ...]  # layer ids whose MLP is an MoE block
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    checkpoint_block: str = "mlp"  # the MoE block's name in checkpoints (Mixtral: block_sparse_moe)

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layers


def moe_config_for(family: str, hf, raw: dict) -> MoEConfig | None:
    """The MoE layout of a supported family (None for dense families)."""
    if family not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return None
    layers = hf.num_hidden_layers
    experts = int(raw.get("num_experts") or raw.get("num_local_experts")
                  or getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts"))
    top_k = int(hf.num_experts_per_tok)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({experts})")
    if family == "mixtral":
        return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=hf.intermediate_size,
                         norm_topk_prob=True, weights_in_model_dtype=False,
                         sparse_layers=tuple(range(layers)), checkpoint_block="block_sparse_moe")
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    sparse = tuple(i for i in range(layers) if i not in only_dense and (i + 1) % step == 0)
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)), weights_in_model_dtype=True,
                     sparse_layers=sparse, shared_expert_intermediate_size=shared)
