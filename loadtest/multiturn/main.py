"""`duet loadtest multiturn [run|compare|report]`."""
from __future__ import annotations

import argparse
import pathlib
import sys


def compare_main(argv: list[str]) -> int:
    from loadtest.multiturn.plots import plot_ttft_by_turn
    from loadtest.multiturn.report_text import render_comparison
    from loadtest.multiturn.results_io import read_result

    p = argparse.ArgumentParser(prog="duet loadtest multiturn compare",
                                description="Two or more multi-turn result files by turn index, side by side.")
    p.add_argument("results", nargs="+", help="results.json files (the first is the baseline)")
    p.add_argument("--output-dir", "-o", help="also write compare.txt and compare_ttft_by_turn.png here")
    args = p.parse_args(argv)
    files = [read_result(r) for r in args.results]
    names = [f.name for f in files]
    # the same label twice (two runs of one setup): number them
    named = [(n if names.count(n) == 1 else f"{n} ({i + 1})", f.summary())
             for i, (n, f) in enumerate(zip(names, files))]
    text = render_comparison(named)
    print(text)
    if args.output_dir:
        out = pathlib.Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.txt").write_text(text + "\n")
        png = plot_ttft_by_turn(named, out / "compare_ttft_by_turn.png",
                                "TTFT by turn: " + " vs ".join(n for n, _ in named))
        print(f"wrote {out / 'compare.txt'}, {png}", file=sys.stderr)
    return 0


def report_main(argv: list[str]) -> int:
    from loadtest.multiturn.report_text import render_turn_table
    from loadtest.multiturn.results_io import read_result

    p = argparse.ArgumentParser(prog="duet loadtest multiturn report", description="A result file's table again.")
    p.add_argument("results", help="results.json")
    p.add_argument("--plots-dir", help="write ttft_by_turn.png here")
    args = p.parse_args(argv)
    f = read_result(args.results)
    summary = f.summary()
    print(render_turn_table(summary, f.meta.get("title", f.name)))
    if args.plots_dir:
        from loadtest.multiturn.plots import plot_ttft_by_turn

        plot_ttft_by_turn([(f.name, summary)], pathlib.Path(args.plots_dir) / "ttft_by_turn.png", f.name)
    return 0


def main(argv: list[str]) -> int:
    command = argv[0] if argv and not argv[0].startswith("-") else "run"
    rest = argv[1:] if argv and argv[0] == command else argv
    if command == "compare":
        return compare_main(rest)
    if command == "report":
        return report_main(rest)
    if command == "run":
        from loadtest.multiturn.cli import config_from, multiturn_parser
        from loadtest.multiturn.command import run_multiturn

        return run_multiturn(config_from(multiturn_parser().parse_args(rest)))
    print(f"duet loadtest multiturn: unknown command {command!r} (run, compare, report)", file=sys.stderr)
    return 2
