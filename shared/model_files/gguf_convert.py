"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

transformers can read GGUF, but its model loader needs `accelerate` and its
`save_pretrained` refuses GGUF-loaded models, so we dequantize the tensors
ourselves with the `gguf` package (names mapped to HF Llama names, q/k rows
un-permuted the way llama.cpp permuted them) and take only the config and the
tokenizer from transformers' GGUF readers.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGUF tensor name (per block) -> HF Llama parameter name.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass
class GGUFLlamaInfo:
    """The few GGUF metadata fields the conversion needs to decide things itself."""

    num_heads: int
    num_kv_heads: int
    rope_theta: float
    has_output_weight: bool
    tokenizer_pre: str | None


def hf_tensor_name(gguf_name: str) -> str:
    """Map one llama GGUF tensor name to its HF Llama name (ValueError if unknown)."""
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a llama model")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves per head)."""
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field_value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_llama_info(reader) -> GGUFLlamaInfo:
    arch = _field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, this one is {arch!r}")
    theta = _field_value(reader, "llama.rope.freq_base")
    return GGUFLlamaInfo(
        num_heads=int(_field_value(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field_value(reader, "llama.attention.head_count_kv")),
        # llama.cpp's default when the key is absent.
        rope_theta=float(theta) if theta is not None else 10000.0,
        has_output_weight=any(t.name == "output.weight" for t in reader.tensors),
        tokenizer_pre=_field_value(reader, "tokenizer.ggml.pre"),
    )


def convert_state_dict(gguf_path: Path, dtype: torch.dtype, progress: bool) -> tuple[dict[str, torch.Tensor], GGUFLlamaInfo]:
    """Dequantize every tensor of a llama GGUF file into HF-named torch tensors."""
    from gguf import GGUFReader, dequantize
    from tqdm import tqdm

    reader = GGUFReader(str(gguf_path))
    info = read_llama_info(reader)
    state: dict[str, torch.Tensor] = {}
    tensors = tqdm(reader.tensors, desc="dequantize", unit="tensor", file=sys.stderr, disable=not progress)
    for tensor in tensors:
        # dequantize returns the HF (row-major, [out, in]) shape, float32.
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, info.num_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, info.num_kv_heads)
        state[hf_tensor_name(tensor.name)] = torch.from_numpy(weight.copy()).to(dtype)
    return state, info


def build_config(gguf_dir: Path, gguf_name: str, info: GGUFLlamaInfo, dtype: torch.dtype):
    """The HF config as transformers reads it from the GGUF, with the fields we rely on made explicit."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = not info.has_output_weight
    config.dtype = dtype
    config._name_or_path = ""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.update({"rope_type": rope.get("rope_type", "default"), "rope_theta": info.rope_theta})
    config.rope_parameters = rope
    return config


def write_config_json(config, out_dir: Path, rope_theta: float) -> None:
    """Save config.json; rope_theta is also written top level so older readers see it."""
    config.save_pretrained(str(out_dir))
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["rope_theta"] = rope_theta
    data.pop("_name_or_path", None)
    data.pop("_model_name_or_path", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_generation_config(config, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out_dir))


# llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the
# GPT-2 regex; transformers' GGUF reader drops that step, so we restore it.
_DIGITS_FIRST_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}


def _fix_tokenizer_files(out_dir: Path, chat_template: str, gguf_pre: str | None, max_length: int) -> None:
    tok_path = out_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    if gguf_pre in _DIGITS_FIRST_PRE and pre.get("type") == "ByteLevel":
        tok["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, dict(pre, add_prefix_space=False)],
        }
        tok_path.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for machine_local in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(machine_local, None)
    # A class name every transformers version knows (the GGUF reader writes a v5-only one).
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg["model_max_length"] = max_length
    cfg["add_bos_token"] = False
    # Some transformers versions write the template only to chat_template.jinja;
    # keep it in tokenizer_config.json too so every reader finds it.
    cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").write_text(chat_template)


def write_tokenizer(gguf_dir: Path, gguf_name: str, out_dir: Path, gguf_pre: str | None, max_length: int) -> None:
    """Save the GGUF's tokenizer (and its chat template) in HF format."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_name} carries no chat template")
    tokenizer.save_pretrained(str(out_dir))
    _fix_tokenizer_files(out_dir, tokenizer.chat_template, gguf_pre, max_length)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16, progress: bool = True, log=None) -> None:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json into out_dir."""
    from safetensors.torch import save_file

    log = log or (lambda msg: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"reading and dequantizing {gguf_path.name}")
    state, info = convert_state_dict(gguf_path, dtype, progress)
    if not info.has_output_weight:
        state.pop("lm_head.weight", None)  # tied: HF checkpoints omit it
    log("writing config and weights")
    config = build_config(gguf_path.parent, gguf_path.name, info, dtype)
    write_config_json(config, out_dir, info.rope_theta)
    write_generation_config(config, out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    log("writing tokenizer")
    write_tokenizer(gguf_path.parent, gguf_path.name, out_dir, info.tokenizer_pre, config.max_position_embeddings)
