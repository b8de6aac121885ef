"""Disaggregated (1 prefill + 1 decode) against one colocated worker, at fixed concurrencies.

    python -m loadtest.bench_disagg                     # concurrencies 1,4,8, random 128->32 tokens
    python -m loadtest.bench_disagg -c 1,2,4 --input-len 256 --output-len 64 -o out/

Starts each stack with `duet up` on this machine in turn (each gets the machine's cores,
shared among its workers the way `duet up` shares them), runs the same closed-loop
workload (same seed, same prompts) with `duet loadtest` at each concurrency, stops the
stack, then prints one table: TTFT, inter-token latency, time per output token and
throughput per stack and concurrency, and the disaggregated/colocated ratios.

Per-run results (results.json, report.txt) go under --output-dir/<stack>/c<N>/, the
combined figures to --output-dir/summary.json. Flags after `--` go to every load test.
On a small shared CPU machine the absolute figures say little about GPUs; the ratio
shows what the split costs or buys at each concurrency on this machine.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass

from loadtest.duet_stack import DuetStack

STACKS = {  # name -> `duet up` flags
    "colocated": ["--both", "1", "--prefill", "0", "--decode", "0"],
    "disagg": ["--prefill", "1", "--decode", "1"],
}


@dataclass
class Figures:
    """One (stack, concurrency) run, milliseconds and per-second rates."""

    stack: str
    concurrency: int
    requests: int
    failed: int
    ttft_p50: float | None
    ttft_p90: float | None
    itl_p50: float | None
    itl_p90: float | None
    tpot_mean: float | None
    output_tok_s: float
    request_s: float

    @classmethod
    def from_summary(cls, stack: str, concurrency: int, s) -> "Figures":
        return cls(stack, concurrency, s.requests, s.failed, s.ttft.p50, s.ttft.p90, s.itl.p50, s.itl.p90,
                   s.tpot.mean, s.output_throughput, s.request_throughput)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_disagg", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrencies", "-c", default="1,4,8", help="closed-loop concurrencies to run")
    p.add_argument("--requests-per-slot", type=int, default=3,
                   help="requests per run = concurrency x this (at least --min-requests)")
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random workload)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (ignore_eos)")
    p.add_argument("--api", choices=("chat", "completions"), default="completions")
    p.add_argument("--stacks", default="colocated,disagg", help="which of: " + ", ".join(STACKS))
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for every `duet up` (repeat)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--nixl-progress-thread (repeat)")
    p.add_argument("--output-dir", "-o", default="loadtest-results/bench-disagg")
    return p.parse_args(argv), extra


def run_stack(name: str, args, extra: list[str], out: pathlib.Path) -> list[Figures]:
    from loadtest.__main__ import main as loadtest_main
    from loadtest.results_io import read_results

    figures = []
    up_args = STACKS[name] + args.up_arg + (["--", *args.worker_arg] if args.worker_arg else [])
    print(f"== {name}: duet up {' '.join(up_args)}", file=sys.stderr, flush=True)
    with DuetStack(up_args, out / name / "logs") as stack:
        for conc in (int(c) for c in args.concurrencies.split(",")):
            run_dir = out / name / f"c{conc}"
            n = max(args.min_requests, conc * args.requests_per_slot)
            rc = loadtest_main([
                "--base-url", stack.url, "--api", args.api, "--workload", "random",
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "-n", str(n),
                "-c", str(conc), "--warmup-requests", str(min(conc, 2)), "--label", f"{name} c={conc}",
                "--no-plots", "--no-progress", "-o", str(run_dir), *extra])
            if rc != 0:
                raise SystemExit(f"{name} c={conc}: load test failed (exit {rc}); see {run_dir}")
            summary = read_results(run_dir / "results.json").summaries()[0]
            figures.append(Figures.from_summary(name, conc, summary))
    return figures


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def render(figures: list[Figures], args) -> str:
    head = (f"{'stack':<10} {'conc':>4} {'reqs':>4} {'fail':>4} {'TTFT p50':>9} {'TTFT p90':>9} "
            f"{'ITL p50':>8} {'ITL p90':>8} {'TPOT':>7} {'out tok/s':>9} {'req/s':>6}")
    lines = [f"random {args.input_len}->{args.output_len} tokens, {args.api} API, closed loop; "
             "latencies in ms", head, "-" * len(head)]
    for f in sorted(figures, key=lambda f: (f.concurrency, f.stack)):
        lines.append(f"{f.stack:<10} {f.concurrency:>4} {f.requests:>4} {f.failed:>4} {_ms(f.ttft_p50):>9} "
                     f"{_ms(f.ttft_p90):>9} {_ms(f.itl_p50):>8} {_ms(f.itl_p90):>8} {_ms(f.tpot_mean):>7} "
                     f"{f.output_tok_s:>9.1f} {f.request_s:>6.2f}")
    by = {(f.stack, f.concurrency): f for f in figures}
    concs = sorted({f.concurrency for f in figures})
    if all(("disagg", c) in by and ("colocated", c) in by for c in concs):
        lines += ["", "disagg / colocated:  TTFT p50   ITL p50   TPOT   out tok/s"]
        for c in concs:
            d, k = by[("disagg", c)], by[("colocated", c)]
            lines.append(f"  conc {c:<3}            {_ratio(d.ttft_p50, k.ttft_p50):>7}  {_ratio(d.itl_p50, k.itl_p50):>7}"
                         f"  {_ratio(d.tpot_mean, k.tpot_mean):>5}  {_ratio(d.output_tok_s, k.output_tok_s):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    out = pathlib.Path(args.output_dir)
    figures: list[Figures] = []
    for name in (n.strip() for n in args.stacks.split(",")):
        if name not in STACKS:
            print(f"unknown stack {name!r}; choose from {', '.join(STACKS)}", file=sys.stderr)
            return 2
        figures += run_stack(name, args, extra, out)
    table = render(figures, args)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps([f.__dict__ for f in figures], indent=1))
    (out / "summary.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
