"""The suite's table (text and Markdown) and its JSON."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from loadtest.hostile.result import ProbeResult

COLUMNS = ("probe", "item", "status", "err JSON", "latency s", "RSS +MB (kept)", "health p50/max ms",
           "victim ms", "verdict", "expected", "why")


def _f(value, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def row(r: ProbeResult) -> list[str]:
    json_ok = "-" if r.error_json is None else ("yes" if r.error_json else "NO")
    rss = "-" if r.rss_delta_mb is None else f"{r.rss_delta_mb:+.0f} ({_f(r.rss_kept_mb, '{:+.0f}')})"
    health = "-" if r.health_p50_ms is None else f"{r.health_p50_ms:.0f}/{r.health_max_ms:.0f}"
    victim = _f(r.victim_ms)
    if r.kv_trace:  # the disconnect probe: KV back to zero instead of a victim
        victim = "KV 0 after " + (_f(r.kv_zero_after_s, "{:.1f}") + " s" if r.kv_zero_after_s is not None
                                  else f">{r.details.get('kv_watch_s', 0):.0f} s")
    reason = r.reason + (f" [before it: {r.details['not_settled']}]" if r.details.get("not_settled") else "")
    return [r.name, r.item, str(r.status), json_ok, _f(r.latency_s, "{:.2f}"), rss, health, victim, r.verdict,
            r.expect, reason]


def summary(results: list[ProbeResult]) -> str:
    counts = Counter(r.verdict for r in results)
    return ", ".join(f"{k} {counts[k]}" for k in ("PASS", "FAIL", "UNCLEAR", "SKIP") if counts[k])


def text_table(results: list[ProbeResult]) -> str:
    rows = [list(COLUMNS)] + [row(r) for r in results]
    shown = len(COLUMNS) - 2  # expectation and reason go on a line of their own
    widths = [max(len(x[i]) for x in rows) for i in range(shown)]
    lines = []
    for k, cells in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells[:shown], widths)).rstrip())
        if k == 0:
            lines.append("-" * len(lines[0]))
        elif cells[8] != "PASS":
            lines.append(f"    expected {cells[9]}: {cells[10]}")
    return "\n".join(lines) + f"\n{summary(results)}"


def markdown_table(results: list[ProbeResult]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(esc(c) for c in row(r)) + " |" for r in results]
    return "\n".join(lines) + f"\n\n{summary(results)}\n"


def write_json(path: str | Path, results: list[ProbeResult], meta: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "probes": [r.to_json() for r in results]}, indent=1, default=str))
