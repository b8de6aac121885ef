"""What a checkpoint's `quantization_config` (config.json) says, and whether we serve it.

Served: FP8 (float8_e4m3fn weights with float32 scales that multiply them):
- Hugging Face / DeepSeek block-wise, the format of the official `*-FP8` releases:
  `{quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic}`,
  tensors `<layer>.weight` + `<layer>.weight_scale_inv` [ceil(N/128), ceil(K/128)];
- per-tensor / per-channel: `quant_method: fp8` without a block size (vLLM's format),
  `fbgemm_fp8`, and compressed-tensors float8 (`config_groups` with 8-bit float weights,
  strategy tensor, channel or block), tensors `<layer>.weight` + `<layer>.weight_scale`.
Activations are always quantized dynamically (per token per 128-column group); a
checkpoint's static `input_scale`s are not used. `--quantization fp8` quantizes a 16-bit
checkpoint block-wise at load ("online"). Every other method is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

ONLINE_BLOCK = (128, 128)  # block of online quantization (DeepSeek's, the official releases')
QUANTIZATION_CHOICES = ("fp8",)  # what --quantization accepts


class QuantizationError(ValueError):
    """A quantization the engine does not serve, with the method named."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How this model's FP8 weights are scaled. block: (rows, columns) of one weight scale,
    or None for per-channel / per-tensor scales (`weight_scale`)."""

    block: tuple[int, int] | None
    online: bool = False  # quantized at load from a 16-bit checkpoint
    source: str = "fp8"  # the checkpoint's method, for messages and logs

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    def describe(self) -> str:
        how = f"block {self.block[0]}x{self.block[1]}" if self.block else "per-channel"
        return f"FP8 {how} ({'quantized at load' if self.online else self.source})"


def _refuse(method: str, detail: str = "") -> QuantizationError:
    return QuantizationError(
        f"quantization method {method!r}{f' ({detail})' if detail else ''} is not supported: Duet serves FP8 "
        f"checkpoints (quant_method fp8 block-wise or per-channel, fbgemm_fp8, compressed-tensors float8) and "
        f"16/32-bit ones (which --quantization fp8 turns into FP8 at load)")


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    blocks = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        kind, bits = str(w.get("type", "int")).lower(), int(w.get("num_bits", 0) or 0)
        if kind != "float" or bits != 8:
            fmt = qc.get("format")
            raise _refuse("compressed-tensors", f"{bits}-bit {kind} weights in {name}"
                          + (f", format {fmt}" if fmt else ""))
        strategy = str(w.get("strategy", "tensor")).lower()
        if strategy == "block":
            blocks.add(tuple(int(b) for b in w.get("block_structure") or ONLINE_BLOCK))
        elif strategy not in ("tensor", "channel"):
            raise _refuse("compressed-tensors", f"float8 weights with strategy {strategy!r}")
    if len(blocks) > 1:
        raise _refuse("compressed-tensors", f"several weight block shapes {sorted(blocks)}")
    return Fp8Scheme(next(iter(blocks)) if blocks else None, source="compressed-tensors float8")


def quant_scheme(raw_config: dict, requested: str | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint (config.json as a dict) and the engine's --quantization
    (None or "fp8"); None: 16/32-bit weights served as they are. Raises QuantizationError
    naming a method we do not serve."""
    if requested not in (None, "", "none", *QUANTIZATION_CHOICES):
        raise QuantizationError(f"--quantization {requested!r} is not supported; choose "
                                f"{' or '.join(QUANTIZATION_CHOICES)} (or leave it unset)")
    qc = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if qc:
        method = str(qc.get("quant_method") or qc.get("quantization_method") or "").lower()
        if not method and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
            method = "bitsandbytes"
        if method == "fp8":
            block = qc.get("weight_block_size")
            return Fp8Scheme(tuple(int(b) for b in block) if block else None, source="fp8")
        if method == "fbgemm_fp8":
            return Fp8Scheme(None, source="fbgemm_fp8")
        if method == "compressed-tensors":
            return _compressed_tensors(qc)
        raise _refuse(method or "unknown", "from config.json's quantization_config")
    if requested == "fp8":
        return Fp8Scheme(ONLINE_BLOCK, online=True)
    return None


# checkpoint tensors that carry scales: weight scales go with their weight, KV-cache scales
# with the layer's attention; a static activation scale is not used (dynamic quantization)
WEIGHT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
KV_SCALE_SUFFIXES = {".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv",
                     ".k_proj.output_scale": "k", ".v_proj.output_scale": "v"}
IGNORED_SUFFIXES = (".input_scale", ".q_proj.output_scale", ".o_proj.output_scale", ".weight_zero_point",
                    ".input_zero_point")
