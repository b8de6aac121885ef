"""The tables a person reads: one run by turn index, and several runs side by side."""
from __future__ import annotations

from typing import Callable

from loadtest.multiturn.turn_metrics import MultiTurnSummary, TurnSummary
from loadtest.report_table import grid, num


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _errors(t: TurnSummary) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(t.errors.items())) or "-"


TURN_COLUMNS: list[tuple[str, Callable[[TurnSummary], str]]] = [
    ("turn", lambda t: "all" if t.turn < 0 else str(t.turn)),
    ("sent", lambda t: str(t.requests)),
    ("ok", lambda t: str(t.completed)),
    ("429", lambda t: str(t.http_429)),
    ("prompt tok", lambda t: num(t.prompt_tokens_mean, 0)),
    ("cached %", lambda t: _pct(t.cache.share)),
    ("TTFT p50", lambda t: num(t.ttft.p50)),
    ("p90", lambda t: num(t.ttft.p90)),
    ("p99", lambda t: num(t.ttft.p99)),
    ("TPOT p50", lambda t: num(t.tpot.p50)),
    ("E2E p50", lambda t: num(t.e2e.p50)),
    ("errors", _errors),
]


def conversations_line(s: MultiTurnSummary) -> str:
    n = sum(s.conversations.values())
    how = ", ".join(f"{k} {v}" for k, v in sorted(s.conversations.items()))
    return f"Conversations: {n} ({how}); {num(s.turns_per_conversation, 2)} turns sent each on average"


def render_turn_table(s: MultiTurnSummary, title: str) -> str:
    o = s.overall
    header = [name for name, _ in TURN_COLUMNS]
    body = [[fn(t) for _, fn in TURN_COLUMNS] for t in [*s.by_turn, s.all_turns]]
    cached = "server sent no cached_tokens" if s.all_turns.cache.reported == 0 else (
        f"{_pct(s.all_turns.cache.share)}% of prompt tokens served from cache")
    return "\n".join([
        title,
        conversations_line(s),
        *grid(header, body, frozenset({len(header) - 1})),
        "Times in ms; prompt tok is the mean per finished request; cached % is cached_tokens / prompt tokens.",
        f"Duration {num(o.duration_s, 2)} s; {num(o.request_throughput, 2)} req/s; "
        f"input {num(o.input_throughput)} tok/s; output {num(o.output_throughput)} tok/s; {cached}.",
    ])


def render_comparison(named: list[tuple[str, MultiTurnSummary]]) -> str:
    """One table per metric: turn indexes down, runs across."""
    metrics: list[tuple[str, Callable[[TurnSummary], str]]] = [
        ("TTFT p50 (ms)", lambda t: num(t.ttft.p50)),
        ("TTFT p90 (ms)", lambda t: num(t.ttft.p90)),
        ("TTFT p99 (ms)", lambda t: num(t.ttft.p99)),
        ("Cached share of prompt tokens (%)", lambda t: _pct(t.cache.share)),
        ("Mean prompt tokens", lambda t: num(t.prompt_tokens_mean, 0)),
        ("Failed requests (of them 429)", lambda t: f"{t.failed} ({t.http_429})"),
    ]
    turns = sorted({t.turn for _, s in named for t in s.by_turn})
    names = [n for n, _ in named]
    out = [f"Runs: {', '.join(names)}"]
    for title, fn in metrics:
        body = []
        for turn in [*turns, -1]:
            row = ["all" if turn < 0 else str(turn)]
            for _, s in named:
                t = s.all_turns if turn < 0 else next((x for x in s.by_turn if x.turn == turn), None)
                row.append("-" if t is None else fn(t))
            body.append(row)
        out += ["", title, *grid(["turn", *names], body, frozenset())]
    body = [[n, num(s.overall.request_throughput, 2), num(s.overall.output_throughput),
             num(s.overall.duration_s, 2), conversations_line(s).split(": ", 1)[1]] for n, s in named]
    header = ["run", "req/s", "out tok/s", "duration s", "conversations"]
    out += ["", "Overall", *grid(header, body, frozenset({0, 4}))]
    return "\n".join(out)
