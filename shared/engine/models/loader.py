"""Load a Hugging Face checkpoint (safetensors, sharded or not) into our model, each TP
rank taking its own shard at load time."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..model_config import ModelConfig, ModelLoadError
from ..parallel.context import TPContext
from .llama import LlamaForCausalLM


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"checkpoint shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, device: torch.device,
               max_positions: int, fused: bool = False, load_format: str = "auto",
               expert_parallel: bool = False) -> LlamaForCausalLM:
    """fused: Triton kernels in the layers (GPU). load_format "dummy": random weights made
    on the device (benchmarks of real shapes without a checkpoint), as vLLM's option.
    expert_parallel: MoE experts split whole across the TP ranks (models/moe.py)."""
    if load_format == "dummy":
        return _dummy_model(cfg, tp, dtype, device, max_positions, fused, expert_parallel)
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    from safetensors import safe_open
    files = _checkpoint_files(cfg.model_dir)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, tp, dtype, "cpu", max_positions, fused, expert_parallel)
    seen: set[int] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = model.param_for(name)
                if target is None:
                    continue
                mod, part, is_bias = target
                tensor = f.get_tensor(name).to(dtype)
                if hasattr(mod, "load_full"):
                    mod.load_full(tensor, part, is_bias)
                else:
                    mod.weight.data.copy_(tensor)
                seen.add(id(mod))
    expected = {id(m) for m in model.modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
    if cfg.tie_word_embeddings:
        expected.discard(id(model.lm_head))
    missing = [n for n, m in model.named_modules() if id(m) in expected and id(m) not in seen]
    for n, m in model.named_modules():  # stacked tensors filled piece by piece (MoE experts)
        if hasattr(m, "missing_weights"):
            missing += [f"{n}.{w}" for w in m.missing_weights()]
    if missing:
        raise ModelLoadError(f"checkpoint in {cfg.model_dir} lacks weights for: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    return model.to(device)


def _dummy_model(cfg, tp, dtype, device, max_positions, fused, expert_parallel) -> LlamaForCausalLM:
    """Weights ~ N(0, 0.02) (norm scales ~ 1), drawn on the device: seconds even for 8B."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp, dtype, "meta", max_positions, fused, expert_parallel)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(1234 + tp.rank)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.data.normal_(1.0, 0.02, generator=gen)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    # rotary tables are buffers computed from the config, not weights: rebuild them for real
    from .layers import RotaryEmbedding
    model.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions, dtype, device, fused)
    for m in model.modules():  # other config-derived buffers (MoE expert maps)
        if hasattr(m, "init_buffers"):
            m.init_buffers()
    return model
