"""`duet loadtest compare` and `duet loadtest report`: work from saved result files."""
from __future__ import annotations

import argparse
import pathlib
import sys

from loadtest.cli_args import add_slo_flags, slo_from
from loadtest.compare import compare_plots, render_compare
from loadtest.report_table import render_table
from loadtest.results_io import read_results


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="duet loadtest compare", description="Two result files side by side.")
    p.add_argument("a", help="results.json (A, the baseline)")
    p.add_argument("b", help="results.json (B)")
    p.add_argument("--output-dir", "-o", help="also write compare.txt and comparison plots here")
    add_slo_flags(p)
    args = p.parse_args(argv)
    a, b = read_results(args.a), read_results(args.b)
    slo = slo_from(args)
    text = render_compare(a, b, slo)
    print(text)
    if args.output_dir:
        out = pathlib.Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.txt").write_text(text + "\n")
        paths = compare_plots(a, b, out, slo)
        print("wrote " + ", ".join(str(x) for x in [out / "compare.txt", *paths]), file=sys.stderr)
    return 0


def report_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="duet loadtest report",
                                description="The table (and plots) of a result file, optionally under other SLOs.")
    p.add_argument("results", help="results.json")
    p.add_argument("--plots-dir", help="write latency_cdf.png (and sweep.png) here")
    add_slo_flags(p)
    args = p.parse_args(argv)
    f = read_results(args.results)
    slo = slo_from(args)
    used = slo if slo.any else f.slo
    summaries = f.summaries(slo)
    print(render_table(summaries, f.meta.get("title", f.name), used))
    if args.plots_dir:
        from loadtest.plots import plot_latency_cdfs, plot_sweep

        out = pathlib.Path(args.plots_dir)
        plot_latency_cdfs([(r.label, r.records) for r in f.runs], out / "latency_cdf.png", used, f.name)
        if len(summaries) > 1:
            plot_sweep({f.name: summaries}, out / "sweep.png", used, f.name)
    return 0
