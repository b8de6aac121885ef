"""Is the engine at full speed right after warm-up? The same traffic twice, timed per step.

    python3 -m loadtest.bench.warm_check [--model qwen3-8b] [--rounds 2]
    python -m loadtest.bench.warm_check --device cpu --model qwen3-0.6b --prompts 3   # checks the script

Starts an engine on a random-weight checkpoint of the shape (overlap scheduling, graphs:
the serving defaults), runs shared/engine/warmup.py as a worker does before it says ready,
then plays one round of load-test-like traffic (waves of --concurrency prompts of random
lengths in [--min-len, --max-len], each decoding --output tokens; waves overlap so prefill
chunks join running decodes), and the same round again with fresh tokens and the same
lengths. Per round: wall time, the slowest step, steps over 2x the round's median step. A
first round slower than the second means warm-up missed something serving meets. Short
table last."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class CompileLog:
    """Triton compiles as they happen (triton's jit cache hook: called on a cache miss,
    before compiling); the rest of a slow first step is cuBLAS, allocator or host work."""

    def __init__(self):
        self.names: list[str] = []
        self.full: list[str] = []  # every compile's signature with its specialisation
        try:
            import triton
            knobs = triton.knobs.runtime
        except (ImportError, AttributeError):
            return
        previous = knobs.jit_cache_hook

        def hook(*args, **kwargs):
            full = str(kwargs.get("repr", "?"))
            self.names.append(full.split("[")[0])
            # the cache key holds each argument's specialisation (types, 16-byte alignment,
            # divisibility by 16, == 1): what makes a call compile again
            self.full.append(full.split("[")[0] + " key=" + str(kwargs.get("key", kwargs.get("specialization_data"))))
            return previous(*args, **kwargs) if previous else None  # falsy: compile as usual
        knobs.jit_cache_hook = hook

    def take(self) -> list[str]:
        out, self.names = self.names, []
        return out


def play_round(engine, rng, lengths, output: int, concurrency: int, compiles: CompileLog | None = None) -> dict:
    from shared.engine import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    pending = list(lengths)
    live: list[str] = []
    steps: list[float] = []
    t0 = time.perf_counter()
    while pending or engine.has_work:
        while pending and len([r for r in live if engine.get(r) is not None]) < concurrency:
            n = pending.pop(0)
            live.append(engine.add_request(rng.integers(10, vocab - 10, size=n).tolist(), params))
        queued = sum(1 for r in live if engine.get(r) is not None)
        before = (engine.stats.prefill_tokens_computed, engine.stats.decode_tokens_computed)
        s = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s)
        names = compiles.take() if compiles else []
        if names or steps[-1] > 0.5:
            pf = engine.stats.prefill_tokens_computed - before[0]
            dc = engine.stats.decode_tokens_computed - before[1]
            print(f"  step {len(steps)}: {steps[-1] * 1e3:.1f} ms, {queued} live requests, planned "
                  f"{pf} prefill + {dc} decode tokens, "
                  f"Triton compiles: {names or 'none'}", flush=True)
    wall = time.perf_counter() - t0
    med = float(np.median(steps))
    return dict(wall_s=wall, steps=len(steps), median_ms=med * 1e3, max_ms=max(steps) * 1e3,
                slow_steps=sum(1 for x in steps if x > 2 * med))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.warm_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=4000)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-warmup", action="store_true", help="skip warm-up (what it buys)")
    a = p.parse_args(argv)
    from shared.engine.warmup import warm_up

    from .gpu_engine import make_engine
    from .shapes import config_only_dir

    work = Path(tempfile.mkdtemp(prefix="warm-check-"))
    cpu = a.device == "cpu"
    eng = make_engine(config_only_dir(a.model, work), load_format="dummy", device=a.device, max_model_len=8192,
                      **({"kv_cache_memory": 64 << 20} if cpu else {}))
    compiles = CompileLog()
    t = time.monotonic()
    warm_s = 0.0 if a.no_warmup else warm_up(eng, full=True if not cpu else None)
    print(f"[warm_check] engine up; warm-up {warm_s:.1f}s (wall {time.monotonic() - t:.1f}s)", flush=True)
    lengths = np.random.default_rng(0).integers(a.min_len, a.max_len + 1, size=a.prompts).tolist()
    if cpu:
        lengths = [min(n, 40) for n in lengths]
    warm_compiles = list(compiles.full)
    compiles.take()
    rows = []
    for r in range(a.rounds):
        res = play_round(eng, np.random.default_rng(100 + r), lengths, a.output, a.concurrency, compiles)
        rows.append(res)
        print(f"[warm_check] round {r + 1}: {res}", flush=True)
    eng.close()
    late = compiles.full[len(warm_compiles):]
    if late:  # each kernel compiled after warm-up beside its warm-up variants: the differing specialisation
        print("\nkernels compiled after warm-up (with the variants warm-up compiled):")
        for full in late:
            name = full.split("[")[0]
            print(f"  late: {full}")
            for w in warm_compiles:
                if w.split("[")[0] == name:
                    print(f"  warm: {w}")
                    diff = [f"{i}: warm {x!r} late {y!r}" for i, (x, y) in
                            enumerate(zip(w.split(","), full.split(","))) if x != y]
                    print(f"        differs at {diff}")
    print(f"\n=== warm_check ({a.model}, {a.prompts} prompts {a.min_len}-{a.max_len} -> {a.output}, "
          f"concurrency {a.concurrency}, warm-up {'off' if a.no_warmup else f'{warm_s:.1f}s'}) ===")
    print(f"{'round':<6}{'wall s':>9}{'steps':>7}{'median ms':>11}{'max ms':>9}{'>2x median':>12}")
    for i, r in enumerate(rows):
        print(f"{i + 1:<6}{r['wall_s']:>9.2f}{r['steps']:>7}{r['median_ms']:>11.2f}{r['max_ms']:>9.1f}"
              f"{r['slow_steps']:>12}")
    if len(rows) > 1:
        print(f"first / second round wall: {rows[0]['wall_s'] / rows[1]['wall_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
