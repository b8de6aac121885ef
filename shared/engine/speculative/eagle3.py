"""EAGLE-3 heads in the public checkpoint format, and the target-side capture of the
hidden states they read.

A head (config.json `LlamaForCausalLMEagle3`) is one Llama decoder layer whose attention
reads [norm(embedding of token t+1), norm(feature at t)] (2 x hidden wide), where the
feature is `fc` applied to the target's residual stream at three depths (3 x target
hidden), or the head's own previous output when it drafts past what the target verified;
then a final norm and an LM head over a reduced vocabulary whose id i is target id
i + d2t[i]. Weights: fc.weight, midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}
_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight,
lm_head.weight, d2t (t2d unused), embed_tokens.weight when the head has its own (else it
shares the target's); safetensors or pytorch_model.bin, with or without a "model." prefix,
the layer as midlayer.* or layers.0.*.

The target captures its residual stream at the input of layers 2, L/2 and L-3 (or of
layer id + 1 for `eagle_aux_hidden_state_layer_ids` in the head's config), as SGLang and
vLLM do, into a static buffer (CUDA-graph safe); forwards larger than the buffer write a
fresh tensor."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..model_config import ModelLoadError
from ..parallel.context import TPContext
from ..models.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, RowParallelLinear, SwiGLU, VocabParallelEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"


class AuxHiddenCapture:
    """The target's residual stream at a few layer inputs, [T, len(layers) * hidden]."""

    def __init__(self, layers: list[int], hidden: int, rows: int, dtype, device, tp: TPContext):
        self.layers = list(layers)
        self.slot = {}
        for i, layer in enumerate(self.layers):
            self.slot.setdefault(layer, []).append(i)
        self.hidden = hidden
        self.tp = tp
        self.buffer = torch.zeros(rows, len(self.layers), hidden, dtype=dtype, device=device)
        self.large: torch.Tensor | None = None  # [T, n, hidden] of the latest forward too big for the buffer

    def capture(self, layer: int, h: torch.Tensor, residual: torch.Tensor | None) -> None:
        slots = self.slot.get(layer)
        if slots is None:
            return
        t = h.shape[0]
        if t <= self.buffer.shape[0]:
            dst = self.buffer[:t]  # a fixed address: CUDA graphs replay this copy
        else:
            if layer == min(self.slot):
                self.large = torch.empty(t, len(self.layers), self.hidden, dtype=self.buffer.dtype,
                                         device=self.buffer.device)
            dst = self.large
        x = h if residual is None else (self.tp.all_reduce(h.clone()) if self.tp.size > 1 else h) + residual
        for s in slots:
            dst[:, s].copy_(x)

    def rows(self, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[n, len(layers) * hidden] of token rows `index` of the latest forward (of
        num_tokens real tokens), a copy."""
        src = self.buffer if num_tokens <= self.buffer.shape[0] else self.large
        return src.index_select(0, index).reshape(index.shape[0], -1)


def read_head_config(head_dir: str | Path) -> dict:
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"EAGLE-3 head folder {head_dir} has no config.json")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise ModelLoadError(f"{path}: architectures {archs} is not an EAGLE-3 head ({ARCHITECTURE})")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{path}: EAGLE-3 heads with {raw['num_hidden_layers']} layers are not supported (1)")
    return raw


def aux_layers(raw: dict, num_target_layers: int) -> list[int]:
    """Target layer inputs to capture: explicit layer ids (their outputs: id + 1) or the default."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) + 1 for i in ids]
    n = num_target_layers
    return [2, n // 2, n - 3]


class _Attention(nn.Module):
    """Llama attention over 2 x hidden inputs (the target's Attention with a wider qkv)."""

    def __init__(self, cfg, hidden: int, dtype, fused: bool):
        super().__init__()
        from ..models.llama import Attention
        wide = _Shape(cfg, hidden_size=2 * hidden)
        self.inner = Attention(wide, 0, TPContext(), dtype, fused)
        self.inner.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hidden, TPContext(), dtype, reduce=False)

    def forward(self, positions, h, rotary, fb):
        return self.inner(positions, h, rotary, fb)


class _Shape:
    """The fields models/llama.Attention reads, from a head config."""

    def __init__(self, base=None, **over):
        if base is not None:
            self.__dict__.update(base.__dict__)
        self.__dict__.update(over)


class Eagle3Head(nn.Module):
    def __init__(self, raw: dict, target_cfg, target_embed: VocabParallelEmbedding, dtype, device,
                 max_positions: int, fused: bool, rows: int):
        super().__init__()
        from transformers import LlamaConfig
        hf = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
        h = hf.hidden_size
        heads = hf.num_attention_heads
        cfg = _Shape(hidden_size=h, num_heads=heads, num_kv_heads=hf.num_key_value_heads or heads,
                     head_dim=getattr(hf, "head_dim", None) or h // heads, attention_bias=bool(raw.get("attention_bias")),
                     qk_norm=False, rms_norm_eps=hf.rms_norm_eps)
        self.cfg = cfg
        self.hidden = h
        self.target_hidden = int(raw.get("target_hidden_size") or target_cfg.hidden_size)
        self.vocab = target_cfg.vocab_size
        self.draft_vocab = int(raw.get("draft_vocab_size") or hf.vocab_size)
        eps = hf.rms_norm_eps
        tp = TPContext()
        self.fc = nn.Linear(3 * self.target_hidden, h, bias=bool(raw.get("bias", False)), dtype=dtype)
        self.own_embed: VocabParallelEmbedding | None = None
        self.target_embed = target_embed
        self.input_layernorm = RMSNorm(h, eps, dtype, fused)
        self.hidden_norm = RMSNorm(h, eps, dtype, fused)
        self.self_attn = _Attention(cfg, h, dtype, fused)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, fused)
        self.mlp = SwiGLU(h, hf.intermediate_size, tp, dtype, fused)
        self.norm = RMSNorm(h, eps, dtype, fused)
        self.lm_head = ParallelLMHead(None, self.draft_vocab, h, tp, dtype)
        self.register_buffer("hot_ids", torch.arange(self.draft_vocab, dtype=torch.int64))
        self.rotary = RotaryEmbedding(hf, cfg.head_dim, max_positions, dtype, device, fused)
        # static inputs (CUDA graphs): target features for extend passes, own output for decode
        self.aux_in = torch.zeros(rows, 3 * self.target_hidden, dtype=dtype, device=device)
        self.own_in = torch.zeros(rows, h, dtype=dtype, device=device)

    @property
    def embed(self):
        return self.own_embed if self.own_embed is not None else self.target_embed

    @torch.inference_mode()
    def forward(self, input_ids, positions, fb):
        """[T, 2 x hidden]: the normed output (for logits) beside the pre-norm one (the next
        decode pass's feature)."""
        t = input_ids.shape[0]
        if fb.attn.is_decode:
            feat = self.own_in[:t]
        else:
            feat = self.fc(self.aux_in[:t])
        emb = self.embed(input_ids)
        residual = feat
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)
        x = self.self_attn(positions, x, self.rotary, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        out, pre = self.norm(x, residual)
        return torch.cat([out, pre], dim=-1)

    @torch.inference_mode()
    def compute_logits(self, h):
        """(logits over the target vocabulary (-inf off the draft vocabulary), pre-norm features)."""
        out, pre = h[:, :self.hidden], h[:, self.hidden:]
        small = self.lm_head(out).float()
        full = torch.full((h.shape[0], self.vocab), float("-inf"), dtype=small.dtype, device=small.device)
        full.index_copy_(1, self.hot_ids, small)
        return full, pre

    # -- loading ---------------------------------------------------------------------------
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        # "midlayer." (EAGLE / SGLang checkpoints) or "layers.0." (some converters): one layer
        names = {_canonical(k): v for k, v in tensors.items()}
        attn = self.self_attn.inner
        d2t = names.pop("d2t", None)
        names.pop("t2d", None)
        if d2t is not None:
            self.hot_ids.copy_(torch.arange(self.draft_vocab, dtype=torch.int64) + d2t.to(torch.int64))
        emb = names.pop("embed_tokens.weight", None)
        if emb is not None:
            self.own_embed = VocabParallelEmbedding(emb.shape[0], emb.shape[1], TPContext(), self.fc.weight.dtype)
            self.own_embed.to(self.fc.weight.device).load_full(emb.to(self.fc.weight.dtype))
        plain = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                 "midlayer.input_layernorm.weight": self.input_layernorm.weight,
                 "midlayer.hidden_norm.weight": self.hidden_norm.weight,
                 "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        if self.fc.bias is not None:
            plain["fc.bias"] = self.fc.bias
        parts = {"midlayer.self_attn.q_proj.weight": (attn.qkv_proj, 0),
                 "midlayer.self_attn.k_proj.weight": (attn.qkv_proj, 1),
                 "midlayer.self_attn.v_proj.weight": (attn.qkv_proj, 2),
                 "midlayer.self_attn.o_proj.weight": (attn.o_proj, 0),
                 "midlayer.mlp.gate_proj.weight": (self.mlp.gate_up_proj, 0),
                 "midlayer.mlp.up_proj.weight": (self.mlp.gate_up_proj, 1),
                 "midlayer.mlp.down_proj.weight": (self.mlp.down_proj, 0),
                 "lm_head.weight": (self.lm_head, 0)}
        missing = [n for n in list(plain) + list(parts) if n not in names]
        if missing:
            raise ModelLoadError(f"EAGLE-3 head lacks weights: {', '.join(missing[:5])}")
        dtype = self.fc.weight.dtype
        with torch.no_grad():
            for n, p in plain.items():
                p.copy_(names.pop(n).to(dtype))
            for n, (mod, part) in parts.items():
                mod.load_full(names.pop(n).to(dtype), part, False)
        unknown = [n for n in names if "rotary" not in n]
        if unknown:
            raise ModelLoadError(f"unexpected EAGLE-3 head tensors: {', '.join(unknown[:5])}")
        if self.own_embed is None and self.hidden != self.target_embed.weight.shape[1]:
            raise ModelLoadError("EAGLE-3 head has no embedding and its width differs from the target's")


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def read_head_weights(head_dir: str | Path) -> dict[str, torch.Tensor]:
    head_dir = Path(head_dir)
    files = sorted(head_dir.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(head_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no EAGLE-3 head weights (*.safetensors or pytorch_model.bin) in {head_dir}")
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def load_head(head_dir, target, dtype, device, max_positions: int, fused: bool, rows: int,
              dummy: bool = False) -> tuple[dict, Eagle3Head]:
    """(head config, head on the device). target: the engine's model (its embedding is shared)."""
    raw = read_head_config(head_dir)
    head = Eagle3Head(raw, target.cfg, target.embed_tokens, dtype, device, max_positions, fused, rows)
    head.to(device)
    if dummy:  # benchmarks: random weights, a random hot vocabulary
        g = torch.Generator(device=device).manual_seed(4321)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.startswith("target_embed"):
                    continue
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02, generator=g)
            head.hot_ids.copy_(torch.randperm(head.vocab, generator=g, device=device)[:head.draft_vocab].sort().values)
    else:
        head.load(read_head_weights(head_dir))
        head.to(device)
    return raw, head
