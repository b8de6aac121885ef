"""PNG plots: latency CDFs per run, and goodput/latency against request rate."""
from __future__ import annotations

import math
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.config import SLO  # noqa: E402
from loadtest.metrics import RunSummary  # noqa: E402
from loadtest.records import RequestRecord  # noqa: E402

_PANELS = (
    ("Time to first token", lambda r: [r.ttft] if r.ttft is not None else [], "ttft_ms"),
    ("Time per output token", lambda r: [r.tpot] if r.tpot is not None else [], "tpot_ms"),
    ("Inter-token latency (per chunk)", lambda r: r.itls, None),
    ("End-to-end latency", lambda r: [r.e2e] if r.e2e is not None else [], "e2e_ms"),
)


def save_figure(fig, path: pathlib.Path, title: str) -> pathlib.Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _unit(max_ms: float) -> tuple[str, float]:
    """Seconds once values run past ten seconds; milliseconds below."""
    return ("seconds", 1000.0) if max_ms > 10_000 else ("milliseconds", 1.0)


def plot_latency_cdfs(series: list[tuple[str, list[RequestRecord]]], path: pathlib.Path, slo: SLO,
                      title: str = "") -> pathlib.Path:
    """One panel a metric, one line a run; dashed lines mark the SLOs."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, values_of, slo_field) in zip(axes.flat, _PANELS):
        curves = []
        for label, records in series:
            ms = np.sort(np.asarray([v for r in records if r.ok for v in values_of(r)], dtype=float)) * 1000
            if ms.size:
                curves.append((label, ms))
        limit = getattr(slo, slo_field) if slo_field else None
        hi = max([c[-1] for _, c in curves] + [limit or 0])
        unit, div = _unit(hi)
        for label, ms in curves:
            ax.step(ms / div, np.arange(1, ms.size + 1) / ms.size, where="post", label=f"{label} (n={ms.size})")
        if limit is not None:
            ax.axvline(limit / div, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        lo = min((c[0] for _, c in curves if c[0] > 0), default=0)
        if lo > 0 and hi / lo > 30:  # spans orders of magnitude: log scale reads better
            ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction of requests" if "chunk" not in name else "fraction of chunks")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path, title or "Latency CDFs")


def plot_sweep(series: dict[str, list[RunSummary]], path: pathlib.Path, slo: SLO, title: str = "") -> pathlib.Path:
    """Against offered request rate: throughput and goodput; TTFT and TPOT p50/p99.
    Several series (e.g. disaggregated vs colocated) share the axes."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paced = {name: sorted((s for s in runs if math.isfinite(s.request_rate)), key=lambda s: s.request_rate)
             for name, runs in series.items()}
    max_rate = max([0.0] + [s.request_rate for runs in paced.values() for s in runs])
    for k, (name, runs) in enumerate(paced.items()):
        if runs:
            c = colors[k % len(colors)]
            x = [s.request_rate for s in runs]
            axes[0].plot(x, [s.request_throughput for s in runs], "o-", color=c, label=f"{name}: throughput")
            axes[0].plot(x, [s.goodput.rate for s in runs], "s--", color=c, label=f"{name}: goodput")
    if max_rate > 0:
        axes[0].plot([0, max_rate], [0, max_rate], color="gray", linewidth=0.8, label="offered rate")
    axes[0].set_title("Completed and good requests")
    axes[0].set_ylabel("requests / s")
    panels = ((axes[1], "Time to first token", lambda s: s.ttft, slo.ttft_ms),
              (axes[2], "Time per output token", lambda s: s.tpot, slo.tpot_ms))
    for ax, name, get, limit in panels:
        peak = max([limit or 0.0] + [get(s).p99 or 0.0 for runs in paced.values() for s in runs])
        unit, div = _unit(peak)
        for k, (series_name, runs) in enumerate(paced.items()):
            c = colors[k % len(colors)]
            x = [s.request_rate for s in runs]
            for pct, style in (("p50", "o-"), ("p99", "^:")):
                y = [math.nan if getattr(get(s), pct) is None else getattr(get(s), pct) / div for s in runs]
                ax.plot(x, y, style, color=c, label=f"{series_name}: {pct}")
        if limit is not None:
            ax.axhline(limit / div, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_title(name)
        ax.set_ylabel(unit)
    for ax in axes:
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return save_figure(fig, path, title or "Request-rate sweep")
