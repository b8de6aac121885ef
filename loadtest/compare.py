"""Two result files side by side: per paired run, each metric for A and B and the change."""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass
from typing import Callable

from loadtest.config import SLO
from loadtest.metrics import RunSummary
from loadtest.report_table import grid, num, slo_text
from loadtest.results_io import ResultFile

LOWER, HIGHER = "lower", "higher"  # which way is better


@dataclass
class CompareRow:
    name: str
    get: Callable[[RunSummary], float | None]
    better: str | None
    digits: int = 1


ROWS = [
    CompareRow("Requests ok", lambda s: s.completed, None, 0),
    CompareRow("Requests failed", lambda s: s.failed, LOWER, 0),
    CompareRow("Request throughput (req/s)", lambda s: s.request_throughput, HIGHER, 2),
    CompareRow("Output throughput (tok/s)", lambda s: s.output_throughput, HIGHER),
    CompareRow("TTFT mean (ms)", lambda s: s.ttft.mean, LOWER),
    CompareRow("TTFT p50 (ms)", lambda s: s.ttft.p50, LOWER),
    CompareRow("TTFT p99 (ms)", lambda s: s.ttft.p99, LOWER),
    CompareRow("ITL p50 (ms)", lambda s: s.itl.p50, LOWER),
    CompareRow("ITL p99 (ms)", lambda s: s.itl.p99, LOWER),
    CompareRow("TPOT mean (ms)", lambda s: s.tpot.mean, LOWER),
    CompareRow("TPOT p50 (ms)", lambda s: s.tpot.p50, LOWER),
    CompareRow("TPOT p99 (ms)", lambda s: s.tpot.p99, LOWER),
    CompareRow("E2E p50 (ms)", lambda s: s.e2e.p50, LOWER),
    CompareRow("E2E p99 (ms)", lambda s: s.e2e.p99, LOWER),
    CompareRow("Goodput share (%)", lambda s: None if s.goodput.share is None else 100 * s.goodput.share, HIGHER),
    CompareRow("Goodput (req/s)", lambda s: s.goodput.rate, HIGHER, 2),
]


def pair_runs(a: list[RunSummary], b: list[RunSummary]) -> list[tuple[RunSummary, RunSummary]]:
    """Same offered rates: pair by rate. Otherwise pair in order."""
    def key(s: RunSummary) -> str:
        return "nan" if math.isnan(s.request_rate) else repr(s.request_rate)

    b_by_rate = {key(s): s for s in b}
    if len(b_by_rate) == len(b) and all(key(s) in b_by_rate for s in a):
        return [(s, b_by_rate[key(s)]) for s in a]
    return list(zip(a, b))


def _change(x: float | None, y: float | None, better: str | None) -> str:
    if x is None or y is None:
        return "-"
    if x == 0:
        return "=" if y == 0 else "new"
    pct = 100.0 * (y - x) / abs(x)
    if abs(pct) < 0.05:
        return "="
    text = f"{pct:+.1f}%"
    if better is not None and abs(pct) >= 1.0:  # below 1% it is noise, not a verdict
        text += " better" if (pct < 0) == (better == LOWER) else " worse"
    return text


def render_compare(a: ResultFile, b: ResultFile, slo: SLO | None = None) -> str:
    sa, sb = a.summaries(slo), b.summaries(slo)
    used = slo if slo is not None and slo.any else a.slo
    out = [f"A = {a.name}  ({a.path})", f"B = {b.name}  ({b.path})", f"Goodput SLO: {slo_text(used)}"]
    for x, y in pair_runs(sa, sb):
        body = [[r.name, num(r.get(x), r.digits), num(r.get(y), r.digits), _change(r.get(x), r.get(y), r.better)]
                for r in ROWS]
        out += ["", *grid([f"A {x.label}  vs  B {y.label}", "A", "B", "B vs A"], body)]
    return "\n".join(out)


def compare_plots(a: ResultFile, b: ResultFile, out_dir: pathlib.Path, slo: SLO | None = None) -> list[pathlib.Path]:
    from loadtest.plots import plot_latency_cdfs, plot_sweep

    used = slo if slo is not None and slo.any else a.slo
    series = [(f"A {r.label}", r.records) for r in a.runs] + [(f"B {r.label}", r.records) for r in b.runs]
    paths = [plot_latency_cdfs(series, out_dir / "compare_latency_cdf.png", used, f"{a.name} (A) vs {b.name} (B)")]
    sa, sb = a.summaries(slo), b.summaries(slo)
    if sum(math.isfinite(s.request_rate) for s in sa) > 1 and sum(math.isfinite(s.request_rate) for s in sb) > 1:
        paths.append(plot_sweep({a.name: sa, b.name: sb}, out_dir / "compare_sweep.png", used,
                                f"{a.name} vs {b.name}"))
    return paths
