"""FP8 checkpoints for tests, made from a 16/32-bit Hugging Face folder the way the published
ones are laid out: every projection of the decoder layers (q/k/v/o, gate/up/down, each
expert's, a shared expert's) in float8_e4m3fn with its scales; embeddings, norms, the LM head
and MoE routers kept as they are.

Formats:
- "block": Hugging Face / DeepSeek (`quant_method: fp8`, `weight_block_size`, tensors
  `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], edge blocks partial);
- "channel", "tensor": `quant_method: fp8` without a block size, `weight_scale` per row or
  one per tensor (vLLM's per-tensor / per-channel format);
- "ct_channel", "ct_tensor": compressed-tensors float8 (`config_groups`, `weight_scale` in
  bfloat16 as llm-compressor writes it).
kv_scales: also write per-layer `self_attn.k_scale` / `v_scale` (FP8 KV-cache scales)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_block

_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized(name: str) -> bool:
    parts = name.split(".")
    return ".layers." in f".{name}" and name.endswith(".weight") and len(parts) > 2 and parts[-2] in _QUANTIZED


def _quant_config(fmt: str, block) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
                "modules_to_not_convert": ["lm_head"]}
    if fmt in ("channel", "tensor"):
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    strategy = fmt.removeprefix("ct_")
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def _quantize(w: torch.Tensor, fmt: str, block) -> dict[str, torch.Tensor]:
    if fmt == "block":
        q, s = quantize_block(w, block)
        return {"weight": q, "weight_scale_inv": s}
    wf = w.float()
    if fmt.endswith("channel"):
        s = wf.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
    else:
        s = (wf.abs().max() / FP8_MAX).reshape(1)  # one scale
    s = s.clamp_min(1e-12)
    if fmt.startswith("ct_"):  # llm-compressor writes scales in the model's dtype, a tensor's as a scalar
        s = s.to(torch.bfloat16)
        s = s.reshape(()) if fmt == "ct_tensor" else s
    return {"weight": (wf / s.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), "weight_scale": s}


def quantize_checkpoint(src: Path, dst: Path, fmt: str = "block", block=(128, 128), kv_scales: bool = False,
                        seed: int = 0) -> Path:
    """Write src's FP8 twin into dst (safetensors + config.json with quantization_config;
    tokenizer and generation files copied)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    layers: set[str] = set()
    for name, t in tensors.items():
        if not _quantized(name):
            out[name] = t
            continue
        stem = name[:-len(".weight")]
        for suffix, v in _quantize(t, fmt, block).items():
            out[f"{stem}.{suffix}"] = v.contiguous()
        if ".self_attn." in name:
            layers.add(name.split(".self_attn.")[0])
    if kv_scales:
        g = torch.Generator().manual_seed(seed)
        for prefix in sorted(layers):
            out[f"{prefix}.self_attn.k_scale"] = (0.05 + torch.rand((), generator=g)).float()
            out[f"{prefix}.self_attn.v_scale"] = (0.05 + torch.rand((), generator=g)).float()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _quant_config(fmt, block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """An FP8 folder's weights dequantized into float32 (a 16/32-bit folder, no
    quantization_config): what transformers runs as the reference."""
    from safetensors.torch import load_file, save_file

    from shared.engine.quantization.checkpoint_fp8 import Fp8Checkpoint
    from shared.engine.quantization.config import quant_scheme

    cfg = json.loads((src / "config.json").read_text())
    fp8 = Fp8Checkpoint(None, quant_scheme(cfg), set(), keep=False)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".k_scale", ".v_scale")):
            continue
        stem = name[:-len(".weight")] if name.endswith(".weight") else None
        scale = next((tensors[stem + s] for s in (".weight_scale_inv", ".weight_scale") if stem and stem + s in tensors),
                     None)
        out[name] = fp8.dense(name, t, scale, quantizable=False).float().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
