"""The shape of a model, read from a Hugging Face folder's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .moe_config import UNSUPPORTED_MOE, MoEConfig, moe_config_for
from .quantization.config import Fp8Scheme, QuantizationError, quant_scheme

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixtures of experts: the same attention as their dense siblings, MoE blocks as the config says
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}


class ModelLoadError(ValueError):
    """A model folder that cannot be served, with a message that says why."""


@dataclass
class ModelConfig:
    model_dir: Path
    architecture: str
    family: str  # llama | qwen2 | qwen3 | qwen3_moe | qwen2_moe | mixtral
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str | None
    hf_config: object  # rope parameters: transformers' PretrainedConfig, or config.json's plain fields
    moe: MoEConfig | None = None  # mixture-of-experts layers (None: a dense model)
    quant: Fp8Scheme | None = None  # FP8 weights (checkpoint or --quantization fp8); None: as stored

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantization: str | None = None) -> "ModelConfig":
        """quantization: the engine's --quantization (None, or "fp8" to quantize a 16-bit
        checkpoint at load); a checkpoint's own quantization_config is read either way."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"model folder not found: {model_dir}")
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model folder")
        raw = json.loads(cfg_path.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            moe_arch = next((a for a in archs if a in UNSUPPORTED_MOE), None)
            if moe_arch is not None:
                moe_names = ", ".join(a for a, f in SUPPORTED_ARCHITECTURES.items() if f in MOE_FAMILIES)
                raise ModelLoadError(
                    f"mixture-of-experts architecture {moe_arch} ({UNSUPPORTED_MOE[moe_arch]}) is not "
                    f"supported; supported MoE architectures: {moe_names}")
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {cfg_path}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        try:  # before transformers reads the config: a method it cannot load is still named here
            quant = quant_scheme(raw, quantization)
        except QuantizationError as exc:
            raise ModelLoadError(f"{model_dir}: {exc}") from None
        family = SUPPORTED_ARCHITECTURES[arch]
        # config.json alone where it states every field we read (the common case): importing
        # transformers' config classes costs a worker 2-6 s of CPU at start; otherwise
        # transformers fills in its per-family defaults
        hf = _plain_config(raw, family)
        if hf is None:
            from transformers import AutoConfig  # heavy; only here
            hf = AutoConfig.from_pretrained(model_dir)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = _eos_ids(model_dir, raw)
        return cls(
            model_dir=model_dir, architecture=arch, family=family,
            hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim, vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", getattr(hf, "tie_word_embeddings", False))),
            attention_bias=_attention_bias(raw, family),
            qk_norm=family in ("qwen3", "qwen3_moe"), eos_token_ids=eos, bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), hf_config=hf,
            moe=moe_config_for(family, hf, raw), quant=quant)


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")

# what the engine reads from a dense model's config; a config.json missing any of them goes
# through transformers, whose defaults differ by family (Qwen2's num_key_value_heads is 32,
# Qwen3's head_dim 128, Llama's derived from the heads)
_PLAIN_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings")


def _plain_config(raw: dict, family: str) -> SimpleNamespace | None:
    """The config as config.json states it, when that is enough: a dense family, every key the
    engine reads present, head_dim given where the family's default is not hidden / heads, and
    plain rotary positions (a scaled rope needs transformers' own init functions). None
    otherwise: the caller asks transformers."""
    if family in MOE_FAMILIES or any(raw.get(k) is None for k in _PLAIN_KEYS):
        return None
    if family == "qwen3" and raw.get("head_dim") is None:
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if theta is None:  # the family's default base: transformers knows it
        return None
    fields = {k: raw[k] for k in _PLAIN_KEYS}
    return SimpleNamespace(**fields, head_dim=raw.get("head_dim"),
                           rope_parameters={"rope_type": "default", "rope_theta": theta})


def _attention_bias(raw: dict, family: str) -> bool:
    """q/k/v biases: Qwen2 has them (Qwen2-MoE names the switch qkv_bias), the rest only if
    the config says attention_bias."""
    if family == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", family == "qwen2"))


def _eos_ids(model_dir: Path, raw: dict) -> list[int]:
    """EOS ids from generation_config.json (what generate() stops on), else config.json."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    for src in ([json.loads(gen.read_text())] if gen.is_file() else []) + [raw]:
        val = src.get("eos_token_id")
        if val is None:
            continue
        ids = list(val) if isinstance(val, list) else [val]
        break
    return [int(i) for i in ids]
