"""The whole stack on the GPUs against the engine's own step (the stack benchmark).

    python3 -m loadtest.bench.stack_gpu --model qwen3-8b --stacks colocated,split \
        --concurrency 1,16,32 --input-len 1024 --output-len 256

For each stack (`duet up` on this host's GPUs, random weights of a real shape drawn on the
GPU from a fixed seed, so every worker holds the same model; the default model's tokenizer):
- warm-up check: the first load-test run right after /health says ready, then the same
  run again (a ready pod should serve at full speed from the first request);
- a sweep: closed-loop concurrencies (--concurrency) or Poisson rates (--rates) with SLOs;
then, with the stacks down, the engine's own decode step at the batch and mean context the
decode worker ran (overlap on, as the workers run), and TPOT / step side by side.
Prints a short table last; JSON under --out (default $OUT or ./stack-gpu)."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

from .stack_runs import copy_tokenizer, run_each, start_run

STACKS = {  # name -> `duet up` worker layout (GPU placement: services/launcher/gpus.py)
    "colocated": ["--both", "1", "--prefill", "0", "--decode", "0"],
    "colocated2": ["--both", "2", "--prefill", "0", "--decode", "0"],
    "split": ["--prefill", "1", "--decode", "1"],
    "colocated_tp2": ["--both", "1", "--prefill", "0", "--decode", "0"],
}
STACK_WORKER_ARGS = {"colocated_tp2": ["--tp", "2"]}  # one worker over two GPUs


def model_folder(name: str, root: pathlib.Path, tokenizer_from: str | None = None) -> pathlib.Path:
    """config.json of the shape + a tokenizer (default: the default model's; its ids fit every
    vocab here)."""
    from .shapes import config_only_dir

    d = config_only_dir(name, root)
    if tokenizer_from:
        src = pathlib.Path(tokenizer_from)
    else:
        from shared.model_files.default_model import resolve_model_dir
        src = pathlib.Path(resolve_model_dir(None))
    copy_tokenizer(src, d)
    return d


def _loadtest(url: str, out: pathlib.Path, label: str, args, *, conc: int | None = None,
              rate: float | None = None, n: int, seed: int = 0) -> dict:
    from loadtest.__main__ import main as loadtest_main
    from loadtest.results_io import read_results

    argv = ["--base-url", url, "--api", "completions", "--workload", "random", "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "-n", str(n), "--label", label, "--no-plots", "--no-progress",
            "-o", str(out), "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
            "--tokenizer", str(args.model_folder),  # the served model's (no default model on a GPU image)
            "--seed", str(seed)]
    argv += ["-c", str(conc)] if conc else ["-r", str(rate)]
    if loadtest_main(argv) != 0:
        raise RuntimeError(f"load test {label} failed; see {out}")
    s = read_results(out / "results.json").summaries()[0]
    return dict(label=label, conc=conc, rate=rate, requests=s.requests, failed=s.failed,
                ttft_p50=s.ttft.p50, ttft_p99=s.ttft.p99, itl_p50=s.itl.p50, itl_p99=s.itl.p99,
                tpot_p50=s.tpot.p50, tpot_mean=s.tpot.mean, out_tok_s=s.output_throughput,
                req_s=s.request_throughput, goodput=s.goodput.rate, good_share=s.goodput.share)


def run_stack(name: str, folder: pathlib.Path, args, out: pathlib.Path) -> list[dict]:
    from loadtest.duet_stack import DuetStack

    worker = ["--load-format", "dummy", "--max-model-len", str(args.max_model_len), *STACK_WORKER_ARGS.get(name, []),
              *args.worker_arg]
    up = STACKS[name] + ["--model", str(folder), *args.up_arg, "--", *worker]
    print(f"== {name}: duet up {' '.join(up)}", file=sys.stderr, flush=True)
    rows = []
    t0 = time.monotonic()
    with DuetStack(up, out / name / "logs") as stack:
        ready_s = time.monotonic() - t0
        first = args.warmup_concurrency
        # the first run after ready vs the same shape again, with fresh prompts (the same
        # seed would hit the prefix cache and make the second run look faster than warm)
        for seed, tag in enumerate(("first", "second"), start=1):
            r = _loadtest(stack.url, out / name / f"warm-{tag}", f"{name} {tag} run", args, conc=first,
                          n=args.warmup_requests, seed=seed)
            rows.append(dict(r, stack=name, kind=f"warm {tag}", ready_s=ready_s))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        points = [("c", int(c)) for c in args.concurrency.split(",") if c] + \
                 [("r", float(x)) for x in args.rates.split(",") if x]
        for kind, v in points:
            n = max(args.min_requests, int(v * args.requests_per_point)) if kind == "c" else \
                max(args.min_requests, int(v * args.seconds_per_rate))
            r = _loadtest(stack.url, out / name / f"{kind}{v}", f"{name} {kind}={v}", args,
                          conc=v if kind == "c" else None, rate=v if kind == "r" else None, n=n, seed=100 + len(rows))
            rows.append(dict(r, stack=name, kind="sweep"))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def engine_steps(folder: pathlib.Path, batches: list[int], ctx: int, args) -> dict[int, float]:
    """The engine's decode step (overlap on, graphs on) at each batch, context ctx."""
    import torch

    from .gpu_engine import decode_step_ms, make_engine, release_memory

    eng = make_engine(folder, load_format="dummy", max_model_len=args.max_model_len,
                      cuda_graph_max_bs=max(batches))
    steps = {b: decode_step_ms(eng, b, ctx, 32, overlap=True) for b in batches}
    eng.close()
    del eng
    release_memory()
    torch.cuda.synchronize()
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.stack_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="shape name (loadtest/bench/shapes.py)")
    p.add_argument("--stacks", default="colocated,split", help="comma list of: " + ", ".join(STACKS))
    p.add_argument("--concurrency", default="1,16,32", help="closed-loop points")
    p.add_argument("--rates", default="", help="Poisson request rates (req/s), e.g. 8,12,16,24")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--requests-per-point", type=float, default=3, help="closed loop: requests = conc x this")
    p.add_argument("--seconds-per-rate", type=float, default=15, help="open loop: requests = rate x this")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--warmup-concurrency", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=12)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-engine-steps", action="store_true")
    p.add_argument("--tokenizer-from", default=None, help="folder with tokenizer files (default: the default model's)")
    p.add_argument("--up-arg", action="append", default=[], help="extra `duet up` flag (repeat)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeat)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "stack-gpu"))
    args = p.parse_args(argv)
    out = start_run(args.out)
    folder = model_folder(args.model, pathlib.Path(tempfile.mkdtemp(prefix="stack-gpu-")), args.tokenizer_from)
    args.model_folder = folder
    rows = run_each(args.stacks, lambda name: run_stack(name, folder, args, out))
    concs = sorted({r["conc"] for r in rows if r["kind"] == "sweep" and r["conc"]})
    steps = {}
    if concs and not args.no_engine_steps:
        ctx = args.input_len + args.output_len // 2  # mean context over a request's decode
        steps = engine_steps(folder, concs, ctx, args)
    (out / "stack_gpu.json").write_text(json.dumps(dict(rows=rows, engine_step_ms=steps), indent=1, default=str))
    print(f"\n=== stack_gpu: {args.model}, random {args.input_len}->{args.output_len}, ms "
          f"(SLO TTFT {args.slo_ttft_ms:.0f} / TPOT {args.slo_tpot_ms:.0f}) ===")
    print(f"{'stack':<11}{'point':<14}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>8}{'ITL p99':>8}{'TPOT p50':>9}"
          f"{'step':>7}{'TPOT/step':>10}{'out tok/s':>10}{'req/s':>7}{'good':>6}")
    for r in rows:
        point = r["kind"] if r["kind"] != "sweep" else (f"c={r['conc']}" if r["conc"] else f"r={r['rate']}")
        step = steps.get(r["conc"]) if r["kind"] == "sweep" else None
        ratio = f"{r['tpot_p50'] / step:.2f}" if step and r["tpot_p50"] else "-"
        good = f"{100 * r['good_share']:.0f}%" if r.get("good_share") is not None else "-"

        def f(v):
            return "-" if v is None else f"{v:.1f}"
        print(f"{r['stack']:<11}{point:<14}{f(r['ttft_p50']):>9}{f(r['ttft_p99']):>9}{f(r['itl_p50']):>8}"
              f"{f(r['itl_p99']):>8}{f(r['tpot_p50']):>9}{(f'{step:.2f}' if step else '-'):>7}{ratio:>10}"
              f"{r['out_tok_s']:>10.0f}{r['req_s']:>7.2f}{good:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
