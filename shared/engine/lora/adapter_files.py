"""Reading a LoRA adapter saved in PEFT's format and checking it against the model, with errors
that name the file and the field.

A folder holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, per adapted module, `...layers.<i>.<block>.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r]. The update is scale * B A with scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). What the engine does not serve is refused by name: DoRA,
trained biases, modules_to_save (extra full layers), per-module ranks or alphas, embedding or
LM-head adapters, expert projections of MoE layers, ranks above --max-lora-rank."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model_config import ModelConfig
from .targets import TARGETS, dense_mlp, module_shape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may precede "weight")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served here, and why."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer, PEFT module name) -> (A [rank, in], B [out, rank]), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    if not (folder / CONFIG_FILE).is_file():
        raise LoraAdapterError(f"{where}: no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
    try:
        conf = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{where}: {CONFIG_FILE} does not read as JSON: {exc}") from None
    rank, scale = _check_config(conf, where, max_rank)
    if not (folder / WEIGHTS_FILE).is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise LoraAdapterError(f"{where}: no {WEIGHTS_FILE}{other}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, SafetensorError) as exc:
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} does not read: {exc}") from None
    weights = _pair_tensors(tensors, cfg, rank, where)
    if not weights:
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return LoraAdapter(name=name, path=str(folder), rank=rank, scale=scale, weights=weights)


def _check_config(conf: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a config the engine serves; LoraAdapterError naming the field otherwise."""
    if not isinstance(conf, dict):
        raise LoraAdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    kind = conf.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {kind!r} is not served (only LORA)")
    rank = conf.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{where}: {CONFIG_FILE} field r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = conf.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    refused = {"use_dora": "DoRA adapters are not served", "modules_to_save": "modules_to_save (full extra layers) "
               "are not served", "rank_pattern": "per-module ranks (rank_pattern) are not served",
               "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not served"}
    for key, why in refused.items():
        if conf.get(key):
            raise LoraAdapterError(f"{where}: {why}")
    if conf.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: trained biases (bias={conf['bias']!r}) are not served; only bias='none'")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _pair_tensors(tensors: dict, cfg: ModelConfig, rank: int, where: str):
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraAdapterError(f"{where}: tensor {key!r} is not a LoRA weight of an attention or MLP "
                                   f"projection (served: {', '.join(TARGETS)})")
        layer, block, module, half = int(m[1]), m[2], m[3], m[4]
        target = TARGETS.get(module)
        if target is None or target.block != block:
            raise LoraAdapterError(f"{where}: tensor {key!r}: module {block}.{module} is not served "
                                   f"(served: {', '.join(TARGETS)})")
        if layer >= cfg.num_layers:
            raise LoraAdapterError(f"{where}: tensor {key!r} names layer {layer}; the model has {cfg.num_layers}")
        if block == "mlp" and not dense_mlp(cfg, layer):
            raise LoraAdapterError(f"{where}: tensor {key!r}: layer {layer} is a mixture of experts; LoRA on "
                                   "MoE layers is served for attention only")
        halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraAdapterError(f"{where}: layer {layer} {module} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = module_shape(cfg, module)
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must be "
                f"({rank}, {fan_in}) and ({fan_out}, {rank}) for this model and r={rank}")
        weights[(layer, module)] = (a.to(torch.float32), b.to(torch.float32))
    return weights
