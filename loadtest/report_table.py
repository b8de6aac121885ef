"""The table a person reads at the end: one column per run (a sweep has several)."""
from __future__ import annotations

import math
from typing import Callable

from loadtest.config import SLO
from loadtest.metrics import Distribution, RunSummary


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def grid(header: list[str], body: list[list[str]], left: frozenset[int] = frozenset({0})) -> list[str]:
    """Aligned rows between rules: the columns in `left` flush left, the rest right."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "-" * max(len(line(r)) for r in [header, *body])
    return [rule, line(header), rule, *[line(r) for r in body], rule]


def _errors(s: RunSummary) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "none"


def _dist_rows(name: str, get: Callable[[RunSummary], Distribution]) -> list[tuple[str, Callable]]:
    return [
        (f"{name} mean / p50 (ms)", lambda s: f"{num(get(s).mean)} / {num(get(s).p50)}"),
        (f"{name} p90 / p99 (ms)", lambda s: f"{num(get(s).p90)} / {num(get(s).p99)}"),
    ]


def slo_text(slo: SLO) -> str:
    parts = [f"{n} <= {v:g} ms" for n, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
             if v is not None]
    return ", ".join(parts) if parts else "none set (every finished request counts)"


def _token_check(s: RunSummary) -> str:
    tc = s.token_check
    if tc.checked == 0:
        return "-"
    with_usage = tc.checked - tc.missing_usage
    if with_usage == 0:
        return "server sent no usage"
    out = f"prompt {with_usage - tc.prompt_mismatches}/{with_usage}"
    out += f", output {with_usage - tc.output_mismatches}/{with_usage} exact"
    if tc.prompt_mismatches or tc.output_mismatches:
        out += f" (max off {max(tc.prompt_max_abs_diff, tc.output_max_abs_diff)})"
    return out


ROWS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("Requests ok / failed", lambda s: f"{s.completed} / {s.failed}"),
    ("Errors", _errors),
    ("Duration (s)", lambda s: num(s.duration_s, 2)),
    ("Request throughput (req/s)", lambda s: num(s.request_throughput, 2)),
    ("Input tokens", lambda s: f"{s.input_tokens:,}"),
    ("Output tokens", lambda s: f"{s.output_tokens:,}"),
    ("Input throughput (tok/s)", lambda s: num(s.input_throughput)),
    ("Output throughput (tok/s)", lambda s: num(s.output_throughput)),
    ("Mean concurrency", lambda s: num(s.mean_concurrency, 2)),
    # Unpaced runs have no schedule to lag behind (their wait is for a concurrency slot).
    ("Max send lag behind schedule (ms)",
     lambda s: num(s.max_send_lag_ms) if math.isfinite(s.request_rate) else "-"),
    *_dist_rows("TTFT", lambda s: s.ttft),
    *_dist_rows("ITL", lambda s: s.itl),
    *_dist_rows("TPOT", lambda s: s.tpot),
    *_dist_rows("E2E latency", lambda s: s.e2e),
    ("Goodput (share of requests)", lambda s: "-" if s.goodput.share is None else f"{100 * s.goodput.share:.1f}%"),
    ("Goodput (req/s)", lambda s: num(s.goodput.rate, 2)),
    ("Usage vs tokenizer", _token_check),
]


def render_table(summaries: list[RunSummary], title: str, slo: SLO) -> str:
    header = ["", *[s.label for s in summaries]]
    body = [[name, *[fn(s) for s in summaries]] for name, fn in ROWS]
    out = [title, *grid(header, body), f"Goodput SLO: {slo_text(slo)}"]
    if any(s.token_check.prompt_mismatches * 2 > s.token_check.checked > 0 for s in summaries):
        out.append("Note: most prompt counts differ from the server's: is --tokenizer the server's model?")
    return "\n".join(out)
