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
    # Qwen3-30B-A3B (config.json values): 48 layers, 128 experts, top-8, hidden 2048, expert
    # intermediate 768; 30.5B parameters, 3.3B active per token
    "qwen3-30b-a3b": ("qwen3_moe", dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768,
                                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
    "qwen3-moe-small": ("qwen3_moe", dict(QWEN3, vocab_size=4096, hidden_size=512, intermediate_size=1024,
                                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                          head_dim=64, moe_intermediate_size=256, num_experts=16,
                                          num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False,
                                          initializer_range=0.1, bos_token_id=1, eos_token_id=2)),
    "llama-small": ("llama", dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2, initializer_range=0.1)),
}


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config(name: str):
    import transformers

    family, kw = SHAPES[name]
    cls = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "qwen3_moe": "Qwen3MoeConfig"}[family]
    return getattr(transformers, cls)(**kw)


def config_only_dir(name: str, root: Path) -> Path:
    """A model folder with config.json alone (the engine's dummy load format)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(name)
    cfg.architectures = [ARCHITECTURES[SHAPES[name][0]]]
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
    fp8_matmul_tflops: float = 0.0  # torch._scaled_mm e4m3 8192^3 (0: not measurable here)


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


def copy_gb_s(device: torch.device) -> float:
    """GB/s of an eager 1 GiB device copy, read + write counted: the benches' copy speed. (Not
    inside a CUDA graph: there the copy becomes a memcpy node, measured ~1.5x slower on an H200.)"""
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    del src, dst
    return 2 * (1 << 29) * 2 / ms / 1e6


def measure_ceilings(device: torch.device) -> Ceilings:
    copy = copy_gb_s(device)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = _time_ms(lambda: a @ b, 20)
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gb_s=copy, matmul_tflops=2 * n ** 3 / ms / 1e9, fp8_matmul_tflops=fp8_matmul_peak(device))


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """torch._scaled_mm of a [M, K] and b [N, K] (both float8_e4m3fn, K contiguous) with unit
    per-tensor scales: cuBLAS's FP8 GEMM, the FP8 ceiling."""
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)


def fp8_matmul_peak(device: torch.device, n: int = 8192) -> float:
    """TFLOP/s of torch._scaled_mm at n^3 on random e4m3 data; 0.0 where it does not run
    (no FP8 tensor cores)."""
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        for _ in range(3):
            scaled_mm(a, b)
        ms = _time_ms(lambda: scaled_mm(a, b), 20)
    except (RuntimeError, AttributeError):
        return 0.0
    finally:
        torch.cuda.empty_cache()
    return 2 * n ** 3 / ms / 1e9


def weight_bytes_read_per_step(model, tied: bool, touched_experts: list[int] | None = None) -> int:
    """Every weight is read once per decode step, except the embedding table (only the
    batch's rows), which is read whole only when it doubles as the LM head, and MoE experts:
    only those the step's tokens route to (touched_experts: per MoE layer, in layer order;
    None counts every expert)."""
    from shared.engine.models.moe import ExpertWeights

    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    skip = {id(p) for m in experts for p in m.parameters(recurse=False)}  # FP8 experts' scales too
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if not tied:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    for i, m in enumerate(experts):
        per_expert = sum(p[0].numel() * p.element_size() for p in m.parameters(recurse=False))
        n = m.place.num_local_experts if touched_experts is None else touched_experts[i]
        total += n * per_expert
    return total


def layer_matmul_params(cfg) -> int:
    """Matmul weights one token multiplies by (MoE: the router and its top-k experts, the
    active parameters)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    o = cfg.num_heads * d * h
    moe = cfg.moe
    total = 0
    for layer in range(cfg.num_layers):
        if moe is not None and moe.is_sparse(layer):
            mlp = h * moe.num_experts + moe.top_k * 3 * h * moe.intermediate_size
            mlp += 3 * h * moe.shared_expert_intermediate_size + (h if moe.shared_expert_intermediate_size else 0)
        else:
            mlp = 3 * h * i
        total += qkv + o + mlp
    return total


def prefill_flops(cfg, prompt_len: int, num_prompts: int) -> float:
    """Matmuls (2 FLOP per weight per token), causal attention (QK^T and PV over the
    lower triangle), and the LM head for each prompt's last token."""
    lin = 2 * layer_matmul_params(cfg) * prompt_len
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len * (prompt_len + 1) / 2
    head = 2 * cfg.vocab_size * cfg.hidden_size
    return num_prompts * (lin + attn + head)


def now() -> float:
    return time.perf_counter()
