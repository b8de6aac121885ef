"""The cost of constrained decoding: decode step time with and without a JSON schema.

    python -m loadtest.bench.grammar_cost                       # CPU: SmolLM2-135M (the default model)
    python -m loadtest.bench.grammar_cost --shape qwen3-0.6b    # GPU: random-weight Qwen3-0.6B shape

Each case adds `batch` requests (random prompts of --ctx tokens), runs them until every
one decodes, then times --steps engine steps (scheduling, forward, mask, sampling, the
host round trip: what a worker loop sees), for the plain loop and the overlap loop. The
constrained requests follow a JSON schema that cannot end within the measured steps (a
long array of objects with bounded strings, integers, enums and booleans), so every row
carries a live grammar; each request has its own matcher, as in serving.

A random-weight shape has no tokenizer of its own: its grammar vocabulary is SmolLM2's
49,152 token strings plus concatenations of pairs of them up to the model's vocabulary
size (151,936 for Qwen3), so the mask is built over a vocabulary of the real size.

Prints ms per step, the ratio constrained / free, and the host time spent filling masks."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

def schema(bounded: bool) -> dict:
    """bounded: strings with maxLength, so even random weights move through every state
    (and those states cost the most to mask in xgrammar); open: plain strings."""
    text = {"type": "string", "maxLength": 16} if bounded else {"type": "string"}
    return {"type": "array", "minItems": 10000, "items": {
        "type": "object", "properties": {
            "name": text,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "maxItems": 3, "items": text},
            "active": {"type": "boolean"}},
        "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}}


SCHEMA = schema(bounded=True)


def synthetic_info(vocab_size: int, stop_ids: list[int]):
    """xgrammar vocabulary of `vocab_size` strings: SmolLM2's, then pairs of them."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.engine.default_model import resolve_model_dir
    base = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    vocab = [bytes(t) if not isinstance(t, bytes) else t for t in base.decoded_vocab]
    rng = np.random.default_rng(0)
    seen = set(vocab)
    while len(vocab) < vocab_size:
        a, b = rng.integers(len(base.decoded_vocab), size=2)
        tok = vocab[a] + vocab[b]
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    return xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)


def build_engine(args):
    from shared.engine import Engine
    from shared.engine.grammar import GrammarBackend

    opts = dict(max_running_requests=max(args.batch), cuda_graph_max_bs=max(args.batch))
    if args.shape:
        from loadtest.bench.shapes import config_only_dir
        model = config_only_dir(args.shape, Path(tempfile.mkdtemp(prefix="duet-grammar-")))
        engine = Engine(model_dir=str(model), load_format="dummy", **opts)
        mc = engine.model_config
        engine._grammars = GrammarBackend(None, mc.vocab_size, mc.eos_token_ids,
                                          info=synthetic_info(mc.vocab_size, mc.eos_token_ids))
    else:
        engine = Engine(model_dir=args.model, kv_cache_memory=512 << 20, **opts)
    return engine


class FillTimer:
    """Wraps GrammarBackend.fill to add up the host time spent building masks."""

    def __init__(self, grammars):
        self.seconds, self.calls = 0.0, 0
        inner = grammars.fill

        def fill(states, bitmask):
            t0 = time.perf_counter()
            try:
                return inner(states, bitmask)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        grammars.fill = fill


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(engine, batch: int, ctx: int, steps: int, grammar, overlap: bool, timer: FillTimer) -> float:
    from shared.engine import SamplingParams
    from shared.engine.overlap import OverlapScheduler

    engine.overlap = OverlapScheduler(engine) if overlap else None
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True, grammar=grammar)
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    rids = [engine.add_request(rng.integers(100, vocab - 100, size=ctx).tolist(), params) for _ in range(batch)]
    while any(engine.get(r) is None or engine.get(r).num_output < 2 for r in rids):
        engine.step()
    for _ in range(4):  # warm: graphs for this batch size, the matchers' first states
        engine.step()
    sync(engine.device)
    timer.seconds, timer.calls = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    assert all(engine.get(r) is not None for r in rids), "a request ended inside the measured steps"
    for r in rids:
        engine.abort(r)
    while engine.has_work:
        engine.step()
    engine.overlap = None
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=None, help="random-weight shape from loadtest/bench/shapes.py "
                                                 "(e.g. qwen3-0.6b); default: --model")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--rounds", type=int, default=3, help="free/json alternations per case (median kept)")
    p.add_argument("--open-strings", action="store_true", help="strings without maxLength (cheaper masks)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.engine.grammar_spec import GrammarSpec
    engine = build_engine(args)
    grammar = GrammarSpec("json_schema", json.dumps(schema(bounded=not args.open_strings)))
    engine.grammars.compile(grammar)  # compiled once per worker: not part of a step
    timer = FillTimer(engine.grammars)
    print(f"model {engine.model_dir.name} on {engine.device}, vocab {engine.model_config.vocab_size}, "
          f"ctx {args.ctx}, {args.steps} steps x {args.rounds} rounds per case, "
          f"{'open' if args.open_strings else 'bounded'} strings")
    print(f"{'loop':8} {'batch':>5} {'free ms':>9} {'json ms':>9} {'ratio':>7} {'fill ms/step':>13}")
    for overlap in (False, True):
        for batch in args.batch:
            free, constrained, fills = [], [], []
            for _ in range(args.rounds):  # alternate, so a noisy neighbour hits both alike
                free.append(step_ms(engine, batch, args.ctx, args.steps, None, overlap, timer))
                constrained.append(step_ms(engine, batch, args.ctx, args.steps, grammar, overlap, timer))
                fills.append(timer.seconds / max(timer.calls, 1) * 1e3)
            f, c = float(np.median(free)), float(np.median(constrained))
            print(f"{'overlap' if overlap else 'plain':8} {batch:5d} {f:9.2f} {c:9.2f} {c / f:7.3f} "
                  f"{float(np.median(fills)):13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
