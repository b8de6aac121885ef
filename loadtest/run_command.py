"""`duet loadtest [run]`: build the workload, run each rate, report, save, plot."""
from __future__ import annotations

import asyncio
import math
import pathlib
import random
import time
from dataclasses import dataclass

from loadtest.arrivals import ArrivalProcess, format_rate
from loadtest.config import RunConfig
from loadtest.endpoint import api_base, discover_model
from loadtest.metrics import RunSummary, summarize
from loadtest.records import RequestRecord
from loadtest.report_table import render_table
from loadtest.results_io import write_results
from loadtest.runner import RateRun, RunResult, check_ignore_eos, run_paced, say, stop_if_all_failed, warm_up
from loadtest.sse_client import PreparedRequest, build_body, make_client
from loadtest.tokenizer_source import TokenCounter, load_tokenizer
from loadtest.workloads.build import build_workload
from loadtest.workloads.request_spec import RequestSpec


def prepare(specs: list[RequestSpec], cfg: RunConfig, model: str, counter: TokenCounter) -> list[PreparedRequest]:
    out = []
    for spec in specs:
        messages = spec.chat_messages() if cfg.endpoint.api == "chat" else None
        prompt = None if messages is not None else spec.completion_prompt()
        out.append(PreparedRequest(build_body(cfg.endpoint, model, messages, prompt, spec.output_len),
                                   counter.prompt_tokens(messages, prompt), spec.output_len))
    return out


def _plans(cfg: RunConfig, specs: list[RequestSpec]) -> list[tuple[str, float, object]]:
    """(label, offered rate, send-time iterator) per run: one per rate, or the trace's own times."""
    if cfg.workload.name == "trace":
        return [("trace", math.nan, iter([s.arrival_at or 0.0 for s in specs]))]
    plans = []
    for rate in cfg.load.request_rates:
        label = f"{format_rate(rate)} req/s" if math.isfinite(rate) else (
            f"conc {cfg.load.max_concurrency}" if cfg.load.max_concurrency else "unpaced")
        times = ArrivalProcess(rate, cfg.load.burstiness).times(random.Random(cfg.workload.seed))
        plans.append((label, rate, times))
    return plans


@dataclass
class Session:
    """What a whole invocation sent: the runs, plus the capability probe (it reaches the
    server too, so server-side counters include it)."""

    runs: list[RunResult]
    probe_requests: int = 0
    ignore_eos_sent: bool = False
    interrupted: bool = False

    @property
    def requests_sent(self) -> int:
        return self.probe_requests + sum(len(r.records) + len(r.warmup) for r in self.runs)


async def _run_all(cfg: RunConfig, url: str, prepared: list[PreparedRequest], specs: list[RequestSpec]) -> Session:
    load = cfg.load
    # A trace plays once (its send times run out); a duration run cycles the pool until time is up.
    count = load.request_limit
    if count is None and load.duration_s is None:
        count = len(prepared)
    conns = load.max_concurrency or 1000
    session = Session([])
    async with make_client(cfg.endpoint, conns) as client:
        session.probe_requests, session.ignore_eos_sent = await check_ignore_eos(client, url, cfg.endpoint, prepared[0])
        for p in prepared if not session.ignore_eos_sent else []:
            p.body.pop("ignore_eos", None)
        warm = await warm_up(client, url, cfg.endpoint, prepared, load.warmup_requests, load.max_concurrency,
                             cfg.output.progress)
        stop_if_all_failed(warm)
        for k, (label, rate, times) in enumerate(_plans(cfg, specs)):
            if k:
                try:
                    await asyncio.sleep(load.sweep_pause_s)
                except asyncio.CancelledError:  # Ctrl-C between runs: report those done
                    asyncio.current_task().uncancel()
                    session.interrupted = True
                    break
            run = RateRun(client, url, cfg.endpoint, prepared, times, count, load.duration_s, load.max_concurrency,
                          load.drain_timeout_s, cfg.output.progress, label)
            started = time.time()
            outcome = await run_paced(run)
            session.runs.append(RunResult(label, rate, outcome.records, started, warm if k == 0 else []))
            if outcome.interrupted:
                session.interrupted = True
                break
    return session


def count_output_tokens(records: list[RequestRecord], counter: TokenCounter, keep_text: bool) -> None:
    """After the run (not during it): re-count each output with our tokenizer."""
    for r in records:
        if r.output_text is not None:
            r.output_tokens_tokenizer = counter.text_tokens(r.output_text)
        if not keep_text:
            r.output_text = None


def title_of(cfg: RunConfig, base: str, model: str, workload_size: int) -> str:
    w = cfg.workload
    what = {"sharegpt": "ShareGPT", "random": f"random {w.input_len}->{w.output_len} tokens",
            "shared-prefix": f"shared prefix {w.sp_groups}x{w.sp_system_len}+{w.sp_question_len}->{w.sp_output_len}",
            "trace": f"trace {w.trace_path}"}[w.name]
    label = f"{cfg.output.label}: " if cfg.output.label else ""
    return f"{label}{cfg.endpoint.api} API at {base}, model {model}, {what}, {workload_size} requests per run"


def run_command(cfg: RunConfig) -> int:
    base = api_base(cfg.endpoint.base_url)
    model = cfg.endpoint.model or discover_model(base, cfg.endpoint.http_headers)
    say(f"loading tokenizer {cfg.tokenizer or '(Duet default model)'}")
    counter = TokenCounter(load_tokenizer(cfg.tokenizer))
    specs = build_workload(cfg.workload, counter)
    prepared = prepare(specs, cfg, model, counter)
    mix = cfg.endpoint.lora_mix  # each request to a model or adapter drawn by weight
    for p, name in zip(prepared, random.Random(cfg.workload.seed).choices(list(mix), list(mix.values()),
                                                                          k=len(prepared)) if mix else []):
        p.body["model"] = name
    say(f"{len(prepared)} {cfg.workload.name} requests ready; sending to {base}{cfg.endpoint.path}")

    session = asyncio.run(_run_all(cfg, base + cfg.endpoint.path, prepared, specs))
    runs = session.runs
    if session.interrupted:
        say("interrupted: reporting what was sent so far (unfinished requests count as 'interrupted')")
    summaries: list[RunSummary] = []
    for run in runs:
        count_output_tokens(run.records, counter, cfg.output.save_text)
        count_output_tokens(run.warmup, counter, cfg.output.save_text)
        summaries.append(summarize(run.label, run.request_rate, run.records, cfg.slo, len(run.warmup)))

    title = title_of(cfg, base, model, len(prepared))
    table = render_table(summaries, title, cfg.slo)
    if mix:  # the same rows per model or adapter
        per = [summarize(f"{r.label} {name}", r.request_rate, [x for x in r.records if x.model == name], cfg.slo)
               for r in runs for name in mix]
        table += "\n" + render_table(per, f"{title}, per model", cfg.slo)
    print(table)
    out_dir = cfg.output.folder(cfg.workload.name)
    meta = {"label": cfg.output.label, "title": title, "base_url": base, "model": model,
            "tokenizer": cfg.tokenizer, "config": cfg.to_json(), "requests_sent": session.requests_sent,
            "probe_requests": session.probe_requests, "ignore_eos_sent": session.ignore_eos_sent,
            "interrupted": session.interrupted}
    write_results(out_dir / "results.json", meta, runs, summaries)
    (out_dir / "report.txt").write_text(table + "\n")
    written = [out_dir / "results.json", out_dir / "report.txt"]
    if cfg.output.plots:
        written += write_plots(runs, summaries, cfg, out_dir, cfg.output.label or pathlib.PurePath(model).name)
    say("wrote " + ", ".join(str(p) for p in written))
    if session.interrupted:
        return 130
    return 0 if any(s.completed for s in summaries) else 1


def write_plots(runs: list[RunResult], summaries: list[RunSummary], cfg: RunConfig, out_dir: pathlib.Path,
                name: str) -> list[pathlib.Path]:
    from loadtest.plots import plot_latency_cdfs, plot_sweep

    paths = [plot_latency_cdfs([(r.label, r.records) for r in runs], out_dir / "latency_cdf.png", cfg.slo,
                               f"Latency CDFs: {name}")]
    if sum(math.isfinite(s.request_rate) for s in summaries) > 1:
        paths.append(plot_sweep({name: summaries}, out_dir / "sweep.png", cfg.slo, f"Request-rate sweep: {name}"))
    return paths
