"""Model shapes for `duet bench` (built from transformers configs, nothing downloaded),
the device's two ceilings, and the byte/FLOP counts that turn them into floors."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Published shapes of the real models (config.json values); weights are random.
QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
             head_dim=128, bos_token_id=151643, eos_token_id=151645)
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)),
    # small random models for greedy-equality checks against transformers
    "qwen3-small": ("qwen3", dict(QWEN3, vocab_size=4096, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=64, tie_word_embeddings=False, initializer_range=0.1,
                                  bos_token_id=1, eos_token_id=2)),
    "llama-small": ("llama", dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2, initializer_range=0.1)),
}


def hf_config(name: str):
    from transformers import LlamaConfig, Qwen3Config

    family, kw = SHAPES[name]
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    return cls(**kw)


def config_only_dir(name: str, root: Path) -> Path:
    """A model folder with config.json alone (the engine's dummy load format)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(name)
    cfg.architectures = ["Qwen3ForCausalLM" if SHAPES[name][0] == "qwen3" else "LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    return d


def random_checkpoint_dir(name: str, root: Path, device: torch.device) -> Path:
    """A small random model saved as safetensors (transformers init on the GPU: fast)."""
    from transformers import AutoModelForCausalLM

    d = root / (name + "-ckpt")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32)
    model.save_pretrained(d, safe_serialization=True)
    del model
    return d


@dataclass
class Ceilings:
    copy_gb_s: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # bf16 8192^3 on random data


def _time_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(device: torch.device) -> Ceilings:
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    copy = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = _time_ms(lambda: a @ b, 20)
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gb_s=copy, matmul_tflops=2 * n ** 3 / ms / 1e9)


def weight_bytes_read_per_step(model, tied: bool) -> int:
    """Every weight is read once per decode step, except the embedding table (only the
    batch's rows), which is read whole only when it doubles as the LM head."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if not tied:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def layer_matmul_params(cfg) -> int:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    o = cfg.num_heads * d * h
    return cfg.num_layers * (qkv + o + 3 * h * i)


def prefill_flops(cfg, prompt_len: int, num_prompts: int) -> float:
    """Matmuls (2 FLOP per weight per token), causal attention (QK^T and PV over the
    lower triangle), and the LM head for each prompt's last token."""
    lin = 2 * layer_matmul_params(cfg) * prompt_len
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len * (prompt_len + 1) / 2
    head = 2 * cfg.vocab_size * cfg.hidden_size
    return num_prompts * (lin + attn + head)


def now() -> float:
    return time.perf_counter()
