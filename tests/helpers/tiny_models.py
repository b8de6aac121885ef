"""Tiny random Hugging Face model folders for engine tests (Llama and Qwen3 shapes).

initializer_range is larger than HF's default so logits are peaked: greedy choices then
have clear margins and comparisons between numerically different paths stay meaningful."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(path: Path, family: str = "qwen3", *, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, head_dim: int = 16, vocab: int = 256,
                    intermediate: int = 128, tie: bool = False, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=tie,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    if family == "qwen3":
        cfg, cls = Qwen3Config(rope_theta=10000.0, **common), Qwen3ForCausalLM
    elif family == "llama":
        cfg, cls = LlamaConfig(rope_theta=10000.0, **common), LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path
