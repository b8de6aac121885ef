"""Load a Hugging Face checkpoint (safetensors, sharded or not) into our model, each TP
rank taking its own shard at load time. FP8 checkpoints (and --quantization fp8) go through
quantization/checkpoint_fp8.py: FP8 layers on the GPU, dequantized weights on the CPU; a
checkpoint's KV-cache scales (k_scale / v_scale) land on each layer's attention."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from kernels.fp8 import FP8_DTYPE

from ..model_config import ModelConfig, ModelLoadError
from ..parallel.context import TPContext
from ..quantization.checkpoint_fp8 import Fp8Checkpoint, is_skipped, kv_scale_target, scale_name
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
               expert_parallel: bool = False, keep_fp8: bool | None = None) -> LlamaForCausalLM:
    """fused: Triton kernels in the layers (GPU). load_format "dummy": random weights made
    on the device (benchmarks of real shapes without a checkpoint), as vLLM's option.
    expert_parallel: MoE experts split whole across the TP ranks (models/moe.py).
    keep_fp8: with an FP8 scheme (cfg.quant), hold FP8 weights in FP8 (default: where the
    kernels run, i.e. fused); False dequantizes them into `dtype` at load (the CPU)."""
    keep = fused if keep_fp8 is None else keep_fp8
    if load_format == "dummy":
        return _dummy_model(cfg, tp, dtype, device, max_positions, fused, expert_parallel, keep)
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    from safetensors import safe_open
    files = _checkpoint_files(cfg.model_dir)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, tp, dtype, "cpu", max_positions, fused, expert_parallel)
    seen: set[int] = set()
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt")) for path in files]
        where = {name: f for f in handles for name in f.keys()}
        fp8 = Fp8Checkpoint(model, cfg.quant, set(where), keep)
        for name, f in where.items():
            if is_skipped(name):
                continue
            kv = kv_scale_target(name)
            if kv is not None:
                _set_kv_scale(model, *kv, f.get_tensor(name))
                continue
            target = model.param_for(name)
            if target is None:
                continue
            mod, part, is_bias = target
            sname = scale_name(where, name)
            tensor = f.get_tensor(name)
            scale = where[sname].get_tensor(sname) if sname else None
            if not is_bias and fp8.holds_fp8(mod):
                fp8.load_into(mod, part, name, tensor, scale)
                seen.add(id(mod))
                continue
            tensor = fp8.dense(name, tensor, scale, quantizable=not is_bias and hasattr(mod, "fp8_layouts"))
            tensor = tensor.to(dtype)
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


def _set_kv_scale(model, layer: int, which: str, tensor: torch.Tensor) -> None:
    """A checkpoint's KV-cache scale for one layer: one value (a per-head tensor gives its
    largest: a larger scale never overflows the cache, it only rounds a little coarser)."""
    if layer >= len(model.layers):
        return
    value = float(tensor.float().abs().max())
    if not value > 0:
        raise ModelLoadError(f"layer {layer}: KV-cache scale {value} must be positive")
    attn = model.layers[layer].self_attn
    if which in ("k", "kv"):
        attn.k_scale = value
    if which in ("v", "kv"):
        attn.v_scale = value


def _dummy_model(cfg, tp, dtype, device, max_positions, fused, expert_parallel, keep_fp8) -> LlamaForCausalLM:
    """Weights ~ N(0, 0.02) (norm scales ~ 1), drawn on the device: seconds even for 8B. With
    an FP8 scheme kept in FP8, the quantizable layers get random FP8 weights directly (no
    16-bit copy: a 30B model's FP8 weights fit where its bf16 ones would not)."""
    from ..quantization.fp8_params import ScaleGrid, fill_random_fp8, make_fp8, refresh_scale_rows
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp, dtype, "meta", max_positions, fused, expert_parallel)
        if cfg.quant is not None and keep_fp8:
            grid = ScaleGrid.of(cfg.quant.block)
            for name, m in model.named_modules():
                if hasattr(m, "fp8_layouts"):
                    for attr, layout in m.fp8_layouts(grid).items():
                        make_fp8(m, attr, layout, name)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(1234 + tp.rank)
    for m in model.modules():
        if getattr(m, "fp8", None):
            refresh_scale_rows(m)
            fill_random_fp8(m, 0.02, gen)
    for name, p in model.named_parameters():
        if p.dtype == FP8_DTYPE or name.endswith("_scale"):
            continue  # filled above
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
