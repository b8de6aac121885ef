"""FP8 checkpoint tensors at load time: which layers hold FP8 weights, each weight paired with
its scale tensor, and what a layer gets from them.

Two ways to take an FP8 (or, with --quantization fp8, a 16-bit) checkpoint tensor:
- keep (GPU): the layer becomes FP8 (fp8_params.make_fp8) and takes its shard of the FP8
  values and of the scales; a 16-bit tensor for an FP8 layer is quantized first.
- dequantize (CPU): the full tensor times its scales, in float32, then cast to the engine's
  dtype and loaded like any 16-bit tensor (what the CPU tests compare with transformers).
A layer that cannot hold FP8 (embeddings, the LM head, MoE routers) always dequantizes.
"""
from __future__ import annotations

import re

import torch

from kernels.fp8 import FP8_DTYPE

from ..model_config import ModelLoadError
from .config import IGNORED_SUFFIXES, KV_SCALE_SUFFIXES, WEIGHT_SCALE_SUFFIXES, Fp8Scheme
from .fp8_params import CheckpointFp8, ScaleGrid, load_fp8_part, make_fp8

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def scale_name(names, weight_name: str) -> str | None:
    """The scale tensor that goes with `<prefix>.weight`, if the checkpoint has one."""
    if not weight_name.endswith(".weight"):
        return None
    stem = weight_name[:-len(".weight")]
    return next((stem + s for s in WEIGHT_SCALE_SUFFIXES if stem + s in names), None)


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") for a KV-cache scale tensor, else None."""
    for suffix, which in KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            m = _LAYER.search(name)
            if m:
                return int(m.group(1)), which
    return None


def is_skipped(name: str) -> bool:
    """Scale tensors loaded with their weight, and static activation scales (not used)."""
    return name.endswith(WEIGHT_SCALE_SUFFIXES) or name.endswith(IGNORED_SUFFIXES)


class Fp8Checkpoint:
    """One model's FP8 loading. keep: hold FP8 in the layers that can (see the module note)."""

    def __init__(self, model, scheme: Fp8Scheme | None, names: set[str], keep: bool):
        self.scheme = scheme
        self.grid = ScaleGrid.of(scheme.block) if scheme is not None else None
        self.names = names
        self.keep = keep and scheme is not None
        self._made: set[int] = set()
        if self.keep:
            for name in sorted(names):
                if is_skipped(name) or kv_scale_target(name) is not None:
                    continue
                if scheme.online or scale_name(names, name) is not None:
                    self._plan(model, name)

    def _plan(self, model, name: str) -> None:
        target = model.param_for(name)
        if target is None:
            return
        mod, _, is_bias = target
        if is_bias or not hasattr(mod, "fp8_layouts") or id(mod) in self._made:
            return
        for attr, layout in mod.fp8_layouts(self.grid).items():
            make_fp8(mod, attr, layout, name.rsplit(".", 1)[0])
        self._made.add(id(mod))

    def holds_fp8(self, mod) -> bool:
        return id(mod) in self._made

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None) -> CheckpointFp8 | None:
        """The tensor as FP8 on this model's grid (None when it is 16-bit and stays so)."""
        if scale is not None:
            if tensor.dtype != FP8_DTYPE:
                raise ModelLoadError(f"{name} has a scale tensor but is {tensor.dtype}, not float8_e4m3fn")
            return CheckpointFp8.from_checkpoint(tensor, scale, self.grid)
        if tensor.dtype == FP8_DTYPE:
            raise ModelLoadError(f"{name} is float8_e4m3fn but the checkpoint has no weight_scale_inv / weight_scale "
                                 f"for it")
        return None

    def load_into(self, mod, part, name: str, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Load one weight tensor into an FP8 layer (quantizing a 16-bit one)."""
        src = self.checkpoint_tensor(name, tensor, scale)
        if src is None:
            src = CheckpointFp8.quantize(tensor, self.grid)
        try:
            attr, index, expert = mod.fp8_slot(part)
        except KeyError as exc:
            raise ModelLoadError(f"{name}: {exc.args[0]}") from None
        if attr in ("w13", "w2") and expert is None:  # expert parallel: another rank's expert
            return
        load_fp8_part(mod, attr, index, src, expert)
        if hasattr(mod, "mark"):
            mod.mark(part[0], expert)

    def dense(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None, quantizable: bool) -> torch.Tensor:
        """The values a 16/32-bit layer takes: an FP8 tensor dequantized (float32); with
        online quantization a quantizable layer's 16-bit tensor quantized and dequantized
        (the numbers an FP8 layer would hold); else the tensor as it is."""
        if self.grid is None:
            if scale is not None or tensor.dtype == FP8_DTYPE:
                raise ModelLoadError(f"{name} is an FP8 tensor but config.json has no quantization_config "
                                     f"saying how it is scaled")
            return tensor
        src = self.checkpoint_tensor(name, tensor, scale)
        if src is None:
            if not (self.scheme.online and quantizable):
                return tensor
            src = CheckpointFp8.quantize(tensor, self.grid)
        return _dequantize(src, self.grid)


def _dequantize(src: CheckpointFp8, grid: ScaleGrid) -> torch.Tensor:
    from kernels.fp8 import Fp8Weight, PER_CHANNEL_GROUP_K
    n = src.q.shape[-2]
    if grid.per_channel:
        return Fp8Weight(src.q, src.scale, torch.arange(n, dtype=torch.int32), PER_CHANNEL_GROUP_K).dequantize()
    rows = (torch.arange(n) // grid.group_n).to(torch.int32)
    return Fp8Weight(src.q, src.scale, rows, grid.group_k).dequantize()
