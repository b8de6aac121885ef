"""Model shapes for `duet bench` (transformers configs, nothing downloaded), the device's
ceilings, and the byte and FLOP counts that turn them into floors."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Published shapes of the real models (their config.json values); the weights are random.
QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
             head_dim=128, bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False)
SMALL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2)
MOE = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8)),
    # 48 layers, 128 experts, top-8: 30.5B parameters, 3.3B active a token
    "qwen3-30b-a3b": ("qwen3_moe", dict(QWEN3, **MOE, hidden_size=2048, intermediate_size=6144,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    # small random checkpoints: greedy tokens against transformers and across TP sizes, dry runs
    "qwen3-small": ("qwen3", dict(QWEN3, **SMALL, head_dim=64)),
    "qwen3-moe-small": ("qwen3_moe", dict(QWEN3, **SMALL, **MOE, head_dim=64, moe_intermediate_size=256,
                                          num_experts=16, num_experts_per_tok=4)),
    "llama-small": ("llama", dict(SMALL, intermediate_size=1408, num_key_value_heads=2, rope_theta=500000.0,
                                  rms_norm_eps=1e-5)),
    "qwen3-tiny": ("qwen3", dict(dict(QWEN3, **SMALL), vocab_size=512, hidden_size=64, intermediate_size=128,  # CPU
                                 head_dim=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
}
CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def hf_config(name: str):
    import transformers

    family, kw = SHAPES[name]
    cfg = getattr(transformers, CLASSES[family][0])(**kw)
    cfg.architectures = [CLASSES[family][1]]
    return cfg


def config_only_dir(name: str, root: Path) -> Path:
    """A model folder holding config.json alone (the engine's dummy load format)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(name).to_dict()))
    return d


def random_checkpoint_dir(name: str, root: Path, device: torch.device) -> Path:
    """A small random model saved as safetensors (transformers' init, seed 0), read by both
    the engine and transformers."""
    from transformers import AutoModelForCausalLM

    d = root / (name + "-ckpt")
    if not d.is_dir():
        torch.manual_seed(0)
        with torch.device(device):
            AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).save_pretrained(d)
    return d


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, reps: int = 20) -> float:
    """Median wall time of fn() with the device synchronised, after three warm calls."""
    times = []
    for i in range(reps + 3):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times[3:])[reps // 2]


@dataclass
class Ceilings:
    copy_gb_s: float  # eager device copy, bytes read + written
    matmul_tflops: float  # bf16 n^3 on random data
    fp8_matmul_tflops: float  # torch._scaled_mm e4m3 n^3, unit per-tensor scales (0: no FP8 here)


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth and matmul peaks of the device (a GPU: a 1 GiB copy and 8192^3 products;
    the CPU of a dry run: 16 MiB and 512^3). The copy is eager: inside a CUDA graph it
    becomes a memcpy node, slower than the copies a step makes."""
    n, elems = (8192, 1 << 29) if device.type == "cuda" else (512, 1 << 23)
    src = torch.randn(elems, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = 4 * elems / median_ms(lambda: dst.copy_(src), device) / 1e6
    del src, dst
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * n ** 3 / 1e9
    matmul = flops / median_ms(lambda: a @ b, device, 5)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), dtype=torch.float32, device=device)
        fp8 = flops / median_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16), device, 5)
    except (RuntimeError, AttributeError, NotImplementedError):
        fp8 = 0.0
    return Ceilings(copy, matmul, fp8)


def weight_bytes_read_per_step(model, tied: bool, experts_share: float = 1.0) -> int:
    """Every weight is read once a decode step, except the embedding table (only the batch's
    rows; read whole where it is the LM head too) and MoE experts (experts_share of each
    layer's local experts)."""
    from shared.engine.models.moe import ExpertWeights

    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    skip = {id(p) for m in experts for p in m.parameters(recurse=False)}
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
                if id(p) not in skip)
    if not tied:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    for m in experts:
        per_expert = sum(p[0].numel() * p.element_size() for p in m.parameters(recurse=False))
        total += experts_share * m.place.num_local_experts * per_expert
    return int(total)


def prefill_flops(cfg, prompt_len: int, num_prompts: int) -> float:
    """Matmuls (2 FLOP a weight a token; MoE: the router and the top-k experts), causal
    attention (QK^T and PV over the lower triangle) and the LM head for each last token."""
    h, d, moe = cfg.hidden_size, cfg.head_dim, cfg.moe
    params = 0
    for layer in range(cfg.num_layers):
        params += h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        if moe is not None and moe.is_sparse(layer):
            shared = moe.shared_expert_intermediate_size
            params += h * moe.num_experts + moe.top_k * 3 * h * moe.intermediate_size + 3 * h * shared + \
                (h if shared else 0)
        else:
            params += 3 * h * cfg.intermediate_size
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * d * prompt_len * (prompt_len + 1) / 2
    return num_prompts * (2 * params * prompt_len + attn + 2 * cfg.vocab_size * h)
