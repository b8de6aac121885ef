"""FP8 accuracy on trained weights, on the CPU.

Random weights give near-flat logits, so on the GPU (fp8_sections.fp8_accuracy, Qwen3-8B's
shape) top-1 agreement moves even with bf16 compute on the same weights, and the figure
cannot be judged. Here the weights are trained ones: the embedded SmolLM2-135M-Instruct,
teacher-forced over ShareGPT conversations (chat template, real text), float32 compute:

  reference        the checkpoint's weights
  fp8 dequantized  --quantization fp8: weights quantized to FP8 in 128 x 128 blocks at load and
                   dequantized (what the CPU engine serves)
  fp8 route        the same FP8 weights kept in FP8, every linear through the torch reference
                   of the GPU kernels' route on Hopper (kernels/fp8_linear.py: activations
                   quantized per token per 128 columns from 2 rows (W8A8: the decode GEMM to
                   32 rows, the GEMM above), weights widened at one row (W8A16)): the GPU
                   path's arithmetic, not its kernels (those are checked against these
                   references in tests/kernels/)
  fp8 route + kv   the same with an FP8 KV cache (--kv-cache-dtype fp8_e4m3, scales 1.0)

each once as one prefill per sequence and once in 8-token chunks (decode sizes, attention
reading the pages). Against the dequantized weights (the issue's aim: logits
cosine >= 0.99, top-1 agreement >= 95%) and against the reference (what FP8 costs), with the
text's perplexity for each.

    PYTHONPATH=. python -m loadtest.bench.fp8_accuracy_cpu [--sequences 4 --tokens 512 --json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

AIM_COS, AIM_TOP1 = 0.99, 0.95


@dataclass
class Row:
    engine: str
    mode: str               # "prefill" (one step per sequence) or "chunks of 8"
    against: str            # "fp8 dequantized" or "reference"
    cos_mean: float
    cos_min: float
    top1: float
    perplexity: float       # of the text under this engine

    @property
    def meets(self) -> bool:
        return self.cos_mean >= AIM_COS and self.top1 >= AIM_TOP1


def conversation_tokens(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` sequences of `length` tokens: ShareGPT conversations in the chat template,
    taken in file order, those long enough."""
    from loadtest.workloads.sharegpt import read_items

    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    out = []
    for item in read_items():
        turns = [{"role": roles[t["from"]], "content": t.get("value") or ""}
                 for t in item.get("conversations") or [] if t.get("from") in roles]
        if len(turns) < 2:
            continue
        text = tokenizer.apply_chat_template(turns, tokenize=False)[:8 * length]  # ample for `length` tokens
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == count:
                return out
    raise RuntimeError(f"only {len(out)} ShareGPT conversations have {length} tokens")


def keep_fp8_route(engine) -> None:
    """Swap the engine's (dequantized) model for one holding FP8 weights, whose linears run
    the torch references of the GPU route (the loader keeps FP8 where the kernels run; here
    it is asked to on the CPU)."""
    from shared.engine.models.loader import load_model

    model = load_model(engine.model_config, engine.tp, engine.dtype, engine.device, engine.max_model_len,
                       fused=False, keep_fp8=True)
    assert sum(1 for m in model.modules() if getattr(m, "fp8", None)) > 0
    engine.model = engine.runner.model = model


def logits_of(engine, seqs: list[list[int]], chunk: int | None) -> torch.Tensor:
    from loadtest.bench.fp8_sections import teacher_forced_logits
    return torch.cat([teacher_forced_logits(engine, s, chunk) for s in seqs])


def perplexity(logits: torch.Tensor, seqs: list[list[int]]) -> float:
    targets = torch.cat([torch.tensor(s[1:]) for s in seqs])
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=8, help="tokens a step in the chunked runs (decode sizes)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from loadtest.bench.fp8_sections import compare_logits
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.model_files.default_model import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    seqs = conversation_tokens(AutoTokenizer.from_pretrained(str(model_dir)), args.sequences, args.tokens)
    common = dict(model_dir=str(model_dir), dtype="float32", device="cpu", max_model_len=args.tokens + 16,
                  kv_cache_memory=256 << 20, enable_prefix_cache=False)
    variants = [("reference", {}, False), ("fp8 dequantized", {"quantization": "fp8"}, False),
                ("fp8 route", {"quantization": "fp8"}, True),
                ("fp8 route + fp8 kv", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, True)]
    logits: dict[tuple[str, str], torch.Tensor] = {}
    t0 = time.monotonic()
    for name, extra, route in variants:
        engine = Engine(EngineConfig(**common, **extra))
        if route:
            keep_fp8_route(engine)
        for mode, chunk in (("prefill", None), (f"chunks of {args.chunk}", args.chunk)):
            logits[name, mode] = logits_of(engine, seqs, chunk)
        engine.close()
    ppl = {key: perplexity(got, seqs) for key, got in logits.items()}
    rows = []
    for (name, mode), got in logits.items():
        for against in ("fp8 dequantized", "reference"):
            if name == against or (name == "reference" and against == "fp8 dequantized"):
                continue
            r = compare_logits(got, logits[against, mode])
            rows.append(Row(name, mode, against, r["cos_mean"], r["cos_min"], r["top1"], ppl[name, mode]))
    ref_ppl = {mode: value for (name, mode), value in ppl.items() if name == "reference"}

    print(f"# FP8 accuracy, CPU: {model_dir.name}, {args.sequences} ShareGPT conversations x {args.tokens} "
          f"tokens teacher-forced, float32 compute ({time.monotonic() - t0:.0f} s)")
    print("# reference perplexity: " + ", ".join(f"{m} {v:.3f}" for m, v in ref_ppl.items()))
    print(f"{'engine':<20} {'mode':<12} {'against':<16} {'cos mean':>9} {'cos min':>8} {'top-1':>6} {'ppl':>7}  aim")
    for r in rows:
        aim = ("meets" if r.meets else "misses") if r.against == "fp8 dequantized" else ""
        print(f"{r.engine:<20} {r.mode:<12} {r.against:<16} {r.cos_mean:>9.5f} {r.cos_min:>8.4f} {r.top1:>6.3f} "
              f"{r.perplexity:>7.3f}  {aim}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference_perplexity": ref_ppl, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
