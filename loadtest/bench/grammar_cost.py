"""The cost of constrained decoding: decode step time with and without a JSON schema.

    python -m loadtest.bench.grammar_cost                       # CPU: SmolLM2-135M (the default model)
    python -m loadtest.bench.grammar_cost --shape qwen3-0.6b    # GPU: random-weight Qwen3-0.6B shape

Each case adds `batch` requests (random prompts of --ctx tokens), runs them until every
one decodes, then times --steps engine steps (scheduling, forward, mask, sampling, the
host round trip: what a worker loop sees), for the plain loop and the overlap loop. The
constrained requests follow a JSON schema that cannot end within the measured steps (a
long array of objects with bounded strings, integers, enums and booleans), so every row
carries a live grammar; each request has its own matcher, as in serving.

A random-weight shape has no tokenizer of its own (and the GPU image none to borrow): its
grammar vocabulary is a synthetic byte-level one of the model's size (151,936 for Qwen3),
see synthetic_vocab, so the mask is built over a vocabulary of the real size.

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


SCHEMA = schema(bounded=False)


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """A byte-level BPE-like vocabulary with no tokenizer file (the GPU image has none and
    no network): the 256 bytes, then pieces drawn like an English/code/JSON BPE's: words
    with or without a leading space or capital, digit runs, punctuation and JSON pairs,
    whitespace runs. Mask cost depends on how many tokens fit a grammar state; this mix
    costs within 2x of SmolLM2's real vocabulary at the same size (measured on CPU: mask
    0.93 vs 0.71 ms a row with bounded strings, 0.056 vs 0.027 ms with open ones)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    weights = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0,
                        2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1])
    weights /= weights.sum()
    punct = [b'{"', b'"}', b'",', b'":', b'["', b'"]', b'":"', b'","', b'},', b'{', b'}', b'[', b']', b',', b':',
             b'.', b'(', b')', b'()', b'):', b';', b'->', b'==', b'!=', b'\\n', b'\\"', b"'", b"',", b'-', b'_']
    vocab, seen = [bytes([b]) for b in range(256)], set()
    seen.update(vocab)
    while len(vocab) < size:
        r = rng.random()
        if r < 0.80:
            word = bytes(rng.choice(letters, size=int(rng.integers(2, 10)), p=weights))
            if rng.random() < 0.15:
                word = word[:1].upper() + word[1:]
            tok = (b" " + word) if rng.random() < 0.5 else word
        elif r < 0.88:
            tok = (b" " if rng.random() < 0.3 else b"") + str(int(rng.integers(0, 10 ** int(rng.integers(1, 4))))).encode()
        elif r < 0.97:
            tok = b"".join(punct[int(i)] for i in rng.integers(len(punct), size=int(rng.integers(1, 3))))
        else:
            tok = b" " * int(rng.integers(2, 16)) if rng.random() < 0.5 else b"\n" + b" " * int(rng.integers(0, 12))
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    return vocab


def synthetic_info(vocab_size: int, stop_ids: list[int]):
    import xgrammar as xgr
    vocab = synthetic_vocab(vocab_size)
    for i in stop_ids:  # special tokens: never text
        vocab[i] = f"<|special_{i}|>".encode()
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)


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
    """Adds up the host time spent filling masks (GrammarBackend.fill) and applying them
    with the logit edits (logit_constraints.apply; on a GPU that is launch time only).
    On a busy shared CPU these are the steadier measure of the cost: fill + apply per step
    against the free step."""

    def __init__(self, grammars):
        from shared.engine import logit_constraints
        self.seconds = self.apply_seconds = 0.0
        self.calls = 0
        inner_fill, inner_apply = grammars.fill, logit_constraints.apply

        def fill(states, bitmask):
            t0 = time.perf_counter()
            try:
                return inner_fill(states, bitmask)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        def apply(logits, rows, constraints):
            t0 = time.perf_counter()
            try:
                return inner_apply(logits, rows, constraints)
            finally:
                self.apply_seconds += time.perf_counter() - t0
        grammars.fill = fill
        logit_constraints.apply = apply  # the sampler looks it up on the module at each call

    def reset(self) -> None:
        self.seconds = self.apply_seconds = 0.0
        self.calls = 0

    def per_step_ms(self) -> tuple[float, float]:
        n = max(self.calls, 1)
        return self.seconds / n * 1e3, self.apply_seconds / n * 1e3


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
    timer.reset()
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
    p.add_argument("--bounded-strings", action="store_true",
                   help="strings with maxLength: every state is visited even with random weights, and "
                        "xgrammar's masks cost ~10x more there (a stress case)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.engine.grammar_spec import GrammarSpec
    engine = build_engine(args)
    grammar = GrammarSpec("json_schema", json.dumps(schema(bounded=args.bounded_strings)))
    engine.grammars.compile(grammar)  # compiled once per worker: not part of a step
    timer = FillTimer(engine.grammars)
    print(f"model {engine.model_dir.name} on {engine.device}, vocab {engine.model_config.vocab_size}, "
          f"ctx {args.ctx}, {args.steps} steps x {args.rounds} rounds per case, "
          f"{'bounded' if args.bounded_strings else 'open'} strings")
    print(f"{'loop':8} {'batch':>5} {'free ms':>9} {'json ms':>9} {'ratio':>7} {'fill ms':>8} {'apply ms':>9} "
          f"{'(fill+apply)/free':>18}")
    for overlap in (False, True):
        for batch in args.batch:
            free, constrained, fills, applies = [], [], [], []
            for _ in range(args.rounds):  # alternate, so a noisy neighbour hits both alike
                free.append(step_ms(engine, batch, args.ctx, args.steps, None, overlap, timer))
                constrained.append(step_ms(engine, batch, args.ctx, args.steps, grammar, overlap, timer))
                fill, apply = timer.per_step_ms()
                fills.append(fill)
                applies.append(apply)
            f, c = float(np.median(free)), float(np.median(constrained))
            fill, apply = float(np.median(fills)), float(np.median(applies))
            print(f"{'overlap' if overlap else 'plain':8} {batch:5d} {f:9.2f} {c:9.2f} {c / f:7.3f} {fill:8.3f} "
                  f"{apply:9.3f} {(fill + apply) / f:18.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
