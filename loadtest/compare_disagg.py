"""Disaggregated (1 prefill + 1 decode) against one colocated worker, at several rates.

    python -m loadtest.compare_disagg --rates 0.5,1,2 -o loadtest-results/disagg-vs-colocated

Starts each stack with `duet up` on this machine in turn, runs the same workload
(same seed, so the same prompts and arrival times) at each rate, stops it, and
writes per-stack results and plots plus a side-by-side comparison:

    OUT/colocated/{results.json,report.txt,latency_cdf.png,sweep.png}
    OUT/disagg/{...}
    OUT/compare/{compare.txt,compare_latency_cdf.png,compare_sweep.png}

Flags after `--` go to every `duet loadtest` run (e.g. -- --workload sharegpt).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from loadtest.duet_stack import DuetStack

STACKS = {  # name -> `duet up` flags
    "colocated": ["--both", "1", "--prefill", "0", "--decode", "0"],
    "disagg": ["--prefill", "1", "--decode", "1"],
}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m loadtest.compare_disagg", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="0.25,0.5,1", help="request rates to sweep on each stack")
    p.add_argument("--num-requests", "-n", type=int, default=24, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="random workload: output tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument("--output-dir", "-o", default="loadtest-results/disagg-vs-colocated")
    p.add_argument("--stacks", default="colocated,disagg", help="which of: " + ", ".join(STACKS))
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for every `duet up` (repeat)")
    return p.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    from loadtest.__main__ import main as loadtest_main

    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    out = pathlib.Path(args.output_dir)
    names = [n.strip() for n in args.stacks.split(",")]
    results = {}
    for name in names:
        print(f"== {name}: duet up {' '.join(STACKS[name] + args.up_arg)}", file=sys.stderr, flush=True)
        with DuetStack(STACKS[name] + args.up_arg, out / name / "logs") as stack:
            rc = loadtest_main([
                "--base-url", stack.url, "--workload", "random", "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "-n", str(args.num_requests), "-r", args.rates,
                "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
                "--warmup-requests", "2", "--label", name, "-o", str(out / name), *extra])
        if rc != 0:
            print(f"{name}: load test failed (exit {rc})", file=sys.stderr)
            return rc
        results[name] = out / name / "results.json"
    if len(results) == 2:
        a, b = results.values()
        return loadtest_main(["compare", str(a), str(b), "-o", str(out / "compare")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
