"""PNG of TTFT by turn index (p50, p90, p99), with the cached share and the prompt length by
turn beside it; several runs share the axes (split vs colocated, cache on vs off, ...)."""
from __future__ import annotations

import math
import pathlib

from loadtest.multiturn.turn_metrics import MultiTurnSummary
from loadtest.plots import plt, save_figure


def _value(x: float | None, scale: float = 1.0) -> float:
    return math.nan if x is None else x * scale


def plot_ttft_by_turn(series: list[tuple[str, MultiTurnSummary]], path: pathlib.Path, title: str = "") -> pathlib.Path:
    fig, (ax_ttft, ax_cache, ax_prompt) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    peak = max([t.ttft.p99 or 0.0 for _, s in series for t in s.by_turn] + [0.0])
    unit, div = ("s", 1000.0) if peak > 10_000 else ("ms", 1.0)
    for k, (name, s) in enumerate(series):
        c = colors[k % len(colors)]
        turns = [t.turn for t in s.by_turn]
        for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax_ttft.plot(turns, [_value(getattr(t.ttft, pct), 1 / div) for t in s.by_turn], style, color=c,
                         label=f"{name}: {pct}")
        if any(t.cache.reported for t in s.by_turn):
            ax_cache.plot(turns, [_value(t.cache.share, 100.0) for t in s.by_turn], "o-", color=c, label=name)
        ax_prompt.plot(turns, [_value(t.prompt_tokens_mean) for t in s.by_turn], "o-", color=c, label=name)
        failed = [(t.turn, t.failed) for t in s.by_turn if t.failed]
        for turn, n in failed:  # failures mark the TTFT panel, where they would otherwise hide
            ax_ttft.annotate(f"{n} failed", (turn, 0), xytext=(0, 4 + 10 * k), textcoords="offset points",
                             color=c, fontsize=7, ha="center")
    ax_ttft.set_title("Time to first token by turn")
    ax_ttft.set_ylabel(unit)
    ax_cache.set_title("Prompt tokens served from cache")
    ax_cache.set_ylabel("% of prompt tokens (usage cached_tokens)")
    ax_cache.set_ylim(0, 105)
    if not ax_cache.lines:
        ax_cache.text(0.5, 0.5, "server reported no cached_tokens", ha="center", va="center",
                      transform=ax_cache.transAxes, color="gray")
    ax_prompt.set_title("Prompt length by turn (mean)")
    ax_prompt.set_ylabel("tokens")
    for ax in (ax_ttft, ax_cache, ax_prompt):
        ax.set_xlabel("turn index (0 = first)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        if ax is not ax_cache:
            ax.set_ylim(bottom=0)
        if ax.lines:
            ax.legend(fontsize=8)
    return save_figure(fig, path, title or "TTFT by turn index")
