"""What a conversation's follow-up turn costs inside the engine (needs CUDA).

`multiturn_device` measured a follow-up turn (~100 new tokens after a ~6k-token cached
conversation) at ~100 ms TTFT through `duet up` with one conversation, against ~240 ms for the
whole first turn (6k tokens from scratch). This probe drives one Engine directly (random weights
of a real shape, no server) through the same shape of conversation and times, from add_request
to the first token: the first turn, each follow-up, and a fresh prompt as long as a follow-up's
new tokens; then profiles one more follow-up (cProfile, the host side; the steps' count and
wall times); once an engine for each --prefill-graphs value (0: prefill steps eager; N: steps
of up to N tokens replay CUDA graphs, shared/engine/prefill_graph.py). Prints a short table last.

    python3 -m loadtest.bench.followup_probe [--model qwen3-8b] [--system 5900] [--delta 110] [--prefill-graphs 0,512]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def first_token_s(engine, prompt: list[int], max_tokens: int, params_cls) -> tuple[float, list[int], list[float]]:
    """(seconds to the first token, every output token, each step's wall seconds)."""
    rid = engine.add_request(list(prompt), params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first, tokens, steps = None, [], []
    while engine.has_work:
        s = time.perf_counter()
        outs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - s)
        for out in outs:
            if out.rid == rid:
                tokens.extend(out.token_ids)
                if first is None and out.token_ids:
                    first = time.perf_counter() - t0
    return first, tokens, steps


def one_engine(args, graphs: int, make_engine, config_only_dir, params_cls) -> tuple[list, str]:
    """The conversation's turns on one engine; (rows, the profiled follow-up's report)."""
    engine = make_engine(config_only_dir(args.model, Path(tempfile.mkdtemp(prefix="followup-"))),
                         load_format="dummy", max_model_len=16384, prefill_graph_max_tokens=graphs)
    rng = np.random.default_rng(0)
    vocab = min(engine.model_config.vocab_size, 32000)
    fresh = lambda n: rng.integers(10, vocab - 10, size=n).tolist()  # noqa: E731
    # warm: a short request and a long one (kernels compiled, graphs captured)
    first_token_s(engine, fresh(256), 4, params_cls)
    first_token_s(engine, fresh(2048), 4, params_cls)
    rows = []
    convo = fresh(args.system)
    t, answer, steps = first_token_s(engine, convo, args.answer, params_cls)
    rows.append(("turn 1", len(convo), t, len(steps)))
    for turn in range(2, args.turns + 1):
        convo = convo + answer + fresh(args.delta)
        t, answer, steps = first_token_s(engine, convo, args.answer, params_cls)
        rows.append((f"turn {turn} (follow-up)", len(convo), t, len(steps)))
    t, _, steps = first_token_s(engine, fresh(args.delta), args.answer, params_cls)
    rows.append(("fresh prompt of the delta's length", args.delta, t, len(steps)))
    convo = convo + answer + fresh(args.delta)
    prof = cProfile.Profile()
    prof.enable()
    t, _, steps = first_token_s(engine, convo, 1, params_cls)
    prof.disable()
    rows.append(("profiled follow-up (max_tokens 1)", len(convo), t, len(steps)))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(12)
    buf.write("steps of the profiled follow-up, ms: " + ", ".join(f"{1e3 * s:.1f}" for s in steps) + "\n")
    engine.close()
    del engine
    return rows, buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--system", type=int, default=5900, help="first turn's prompt tokens")
    p.add_argument("--delta", type=int, default=110, help="new tokens a follow-up adds (user turn + template)")
    p.add_argument("--answer", type=int, default=48, help="tokens each turn generates")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--dry-run", action="store_true", help="on the CPU (a small shape: checks the probe runs)")
    p.add_argument("--prefill-graphs", default="0,512",
                   help="engine --prefill-graph-max-tokens values to run one after another (0: eager prefill)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    from shared.engine.sampling_params import SamplingParams
    from .gpu_engine import make_engine
    from .shapes import config_only_dir

    table = []
    for graphs in (int(v) for v in args.prefill_graphs.split(",")):
        rows, profile = one_engine(args, graphs, make_engine, config_only_dir, SamplingParams)
        table += [(graphs, *r) for r in rows]
        print(f"--- prefill graphs up to {graphs} tokens: the profiled follow-up ---")
        print(profile)
        if torch.cuda.is_available():
            from .gpu_engine import release_memory
            release_memory()  # the engine's cycles collected, its memory returned before the next
    print(f"\n| {args.model}, random weights | prefill graphs up to | prompt tokens | first token ms | engine steps |")
    print("|---|---|---|---|---|")
    for graphs, label, n, t, k in table:
        print(f"| {label} | {graphs or 'off'} | {n} | {1e3 * t:.1f} | {k} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
