"""Test helpers for the engine: random-weight HF model folders built from transformers
configs, HF reference generation, and a loop that drives our engine to completion.

Weights are drawn with a fixed seed and a large init scale so greedy outputs are varied
(not one token repeated), and norm weights / biases are perturbed so loading them wrongly
changes the outputs."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class name, overrides). Cover tied/untied embeddings, GQA ratios, Qwen2
# biases, a Qwen3 whose head_dim differs from hidden/heads, and rope scalings.
SMALL_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_tied_gqa2": ("LlamaConfig", dict(tie_word_embeddings=True, initializer_range=0.3)),
    "llama_untied_mha_llama3rope": ("LlamaConfig", dict(
        tie_word_embeddings=False, num_key_value_heads=4, initializer_range=0.3,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "llama_mqa_linearrope": ("LlamaConfig", dict(
        tie_word_embeddings=False, num_key_value_heads=1, initializer_range=0.3,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    "qwen2_untied_bias": ("Qwen2Config", dict(tie_word_embeddings=False, initializer_range=0.3)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=1,
                                       initializer_range=0.3)),
    "qwen3_headdim32": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32,
                                            initializer_range=0.3)),
    "qwen3_tied_gqa4": ("Qwen3Config", dict(tie_word_embeddings=True, num_attention_heads=8,
                                            num_key_value_heads=2, head_dim=16,
                                            initializer_range=0.3)),
}

# mixtures of experts: a dense layer beside an MoE one (Qwen's mlp_only_layers), a number of
# experts that is not a power of two, Qwen2-MoE's sigmoid-gated shared expert, top-k 1..3,
# renormalised top-k or not
MOE_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        tie_word_embeddings=False, head_dim=16, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.3)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", dict(
        tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, initializer_range=0.3)),
    "mixtral": ("MixtralConfig", dict(
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.3)),
}


def make_config(kind: str, **overrides):
    import transformers
    cls_name, extra = SMALL_CONFIGS.get(kind) or MOE_CONFIGS[kind]
    kw = {**SMALL, **extra, **overrides}
    if cls_name != "LlamaConfig":
        kw.setdefault("use_sliding_window", False)
    return getattr(transformers, cls_name)(**kw)


def build_model_dir(path: Path, kind: str, seed: int = 0, max_shard_size: str | None = None,
                    tokenizer_from: Path | None = None, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    """Save a random-weight model of config `kind` into `path` (safetensors)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    cfg = make_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model = model.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(path)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, path)
    return path


def with_real_tokenizer(tmp_path_factory, kind: str, seed: int) -> Path:
    """A random-weight model of `kind` in a fresh folder, with the embedded default model's
    tokenizer (grammars, stop strings and chat need real text)."""
    from tests.helpers.stack import model_dir as default_model_dir
    return build_model_dir(tmp_path_factory.mktemp(kind) / kind, kind, seed=seed, tokenizer_from=default_model_dir())


def copy_tokenizer(src: Path, dst: Path) -> None:
    """A real tokenizer for a random model (ids below the small vocab decode to real text)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 1) -> list[list[int]]:
    """Token-id prompts avoiding the low special ids (0..15), so EOS (2) is never in a prompt."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


# -- HF reference --------------------------------------------------------------------------
def load_hf(model_dir: Path, dtype: torch.dtype, **kw):
    from transformers import AutoModelForCausalLM
    # eager experts: transformers' default grouped_mm has no float64
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                 experts_implementation="eager", **kw)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int, **gen_kw) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding), stopping at EOS."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, num_beams=1, top_k=None, top_p=None, temperature=None,
                         **gen_kw)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits, row i predicting token i+1 (float64)."""
    ids = torch.tensor([tokens])
    return model(ids).logits[0].double()


# -- driving our engine --------------------------------------------------------------------
@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None
    text: str | None = None
    num_cached_tokens: int = 0


def run_engine(engine, prompts: list[list[int]], params, max_steps: int = 100_000,
               rids: list[str] | None = None) -> list[Result]:
    """Add every prompt at once, step until all finish; results in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp, rid=(rids[i] if rids else None))
           for i, (p, sp) in enumerate(zip(prompts, params))]
    results = {rid: Result() for rid in ids}
    steps = 0
    while engine.has_work:
        for out in engine.step():
            r = results[out.rid]
            r.token_ids.extend(out.token_ids)
            r.logprobs.extend(out.logprobs)
            r.top_logprobs.extend(out.top_logprobs)
            r.num_cached_tokens = out.num_cached_tokens
            if out.text is not None:
                r.text = out.text
            if out.finished:
                r.finish_reason, r.stop_reason = out.finish_reason, out.stop_reason
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return [results[rid] for rid in ids]


def assert_all_pages_free(engine) -> None:
    """Every page is free or cached-and-evictable, nothing is locked or reserved."""
    engine.check_idle()
    kv = engine.kv
    assert kv.allocator.num_free + kv.cache.num_cached_pages == kv.capacity
    assert kv.cache.num_locked_pages == 0
    assert engine.kv_usage == 0
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def kv_bytes_for_pages(model_dir: Path, num_pages: int, page_size: int, elem_bytes: int = 8) -> int:
    """The kv_cache_memory that gives exactly num_pages pages (one is the padding page)."""
    from shared.engine.model_config import ModelConfig
    mc = ModelConfig.from_dir(model_dir)
    return num_pages * mc.num_layers * 2 * mc.num_kv_heads * page_size * mc.head_dim * elem_bytes
