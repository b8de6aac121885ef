"""A dense model's shape read from config.json alone (no transformers import at a worker's start)
equals what transformers' own config classes make of the same file, rotary tables included; a
config that leaves a field to its family's default goes through transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from shared.engine.model_config import ModelConfig
from shared.engine.models.layers import RotaryEmbedding

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000, rms_norm_eps=1e-5, max_position_embeddings=512)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, rope_theta=50000.0, architectures=["LlamaForCausalLM"]),
    "mistral": lambda: MistralConfig(**SHAPE, architectures=["MistralForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=48, architectures=["Qwen3ForCausalLM"]),
}
FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
          "qk_norm", "eos_token_ids", "bos_token_id", "family")


def _through_transformers(model_dir) -> tuple[ModelConfig, object]:
    """The same reading with transformers' config class standing in for the plain one."""
    cfg = ModelConfig.from_dir(model_dir)
    hf = AutoConfig.from_pretrained(model_dir)
    assert type(cfg.hf_config).__name__ == "SimpleNamespace", "config.json should have been enough"
    return cfg, hf


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_plain_config_equals_transformers_reading(tmp_path, family):
    CONFIGS[family]().save_pretrained(tmp_path)
    cfg, hf = _through_transformers(tmp_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    want = dict(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, vocab_size=hf.vocab_size,
                rms_norm_eps=hf.rms_norm_eps, max_position_embeddings=hf.max_position_embeddings)
    assert {k: getattr(cfg, k) for k in want} == want
    plain = RotaryEmbedding(cfg.hf_config, cfg.head_dim, 64, torch.float32, "cpu")
    theirs = RotaryEmbedding(hf, cfg.head_dim, 64, torch.float32, "cpu")
    assert torch.equal(plain.cos, theirs.cos) and torch.equal(plain.sin, theirs.sin)


def test_a_field_left_to_the_family_default_goes_through_transformers(tmp_path):
    Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"]).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["num_key_value_heads"]  # Qwen2's default is 32, not the head count
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(tmp_path)
    assert type(cfg.hf_config).__name__ != "SimpleNamespace"
    assert cfg.num_kv_heads == AutoConfig.from_pretrained(tmp_path).num_key_value_heads


def test_scaled_rope_goes_through_transformers(tmp_path):
    LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0},
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert type(cfg.hf_config).__name__ != "SimpleNamespace"


def test_reading_a_plain_config_never_imports_transformers(tmp_path):
    CONFIGS["llama"]().save_pretrained(tmp_path)
    code = ("import sys; from shared.engine.model_config import ModelConfig; "
            f"c = ModelConfig.from_dir({str(tmp_path)!r}); "
            "from shared.engine.models.layers import RotaryEmbedding; import torch; "
            "RotaryEmbedding(c.hf_config, c.head_dim, 16, torch.float32, 'cpu'); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
