"""`duet loadtest multiturn`: build conversations, drive them turn by turn, report by turn."""
from __future__ import annotations

import asyncio
import pathlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from loadtest.arrivals import format_rate
from loadtest.endpoint import api_base, discover_model, served_context_len
from loadtest.multiturn.build import build_dialogs
from loadtest.multiturn.config import MultiTurnConfig
from loadtest.multiturn.dialog import INTERRUPTED, DialogState
from loadtest.multiturn.driver import TurnSender, run_lockstep, run_staggered
from loadtest.multiturn.report_text import render_turn_table
from loadtest.multiturn.results_io import MultiTurnResult, write_result
from loadtest.multiturn.timing import plan_timing
from loadtest.multiturn.turn_record import DialogOutcome, TurnRecord
from loadtest.progress import Progress
from loadtest.records import RequestRecord
from loadtest.run_command import count_output_tokens
from loadtest.runner import check_ignore_eos, say, stop_if_all_failed
from loadtest.sse_client import PreparedRequest, build_body, make_client, monotonic_from, send_streaming
from loadtest.tokenizer_source import TokenCounter, load_tokenizer

# Warm-up shares no prefix with any workload, so turn 0's cached share stays the workload's own.
WARMUP_MESSAGES = [{"role": "user", "content": "Reply with one short greeting."}]


@dataclass
class Drive:
    """What a run sent: the turns, the warm-up, the ignore_eos probe."""

    turns: list[TurnRecord] = field(default_factory=list)
    warmup: list[RequestRecord] = field(default_factory=list)
    probe_requests: int = 0
    ignore_eos_sent: bool = False
    interrupted: bool = False
    started_unix: float = 0.0
    round_metrics: list[dict] = field(default_factory=list)  # --scrape-metrics readings by round


async def scrape_duet_series(urls: list[str]) -> dict[str, dict[str, float]]:
    """url -> {'name{label="v",...}': value} for every duet_* sample (a failed read: {})."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=10.0) as client:
        for url in urls:
            series: dict[str, float] = {}
            try:
                for family in text_string_to_metric_families((await client.get(url)).text):
                    for sample in family.samples:
                        if sample.name.startswith("duet_"):
                            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                            series[f"{sample.name}{{{labels}}}"] = sample.value
            except Exception as exc:  # noqa: BLE001 - a counter we cannot read must not stop the run
                say(f"could not read {url}: {exc}")
            out[url] = series
    return out


async def _warm_up(cfg: MultiTurnConfig, client, url: str, model: str, counter: TokenCounter, drive: Drive) -> None:
    body = build_body(cfg.endpoint, model, WARMUP_MESSAGES, None, 4)
    sample = PreparedRequest(body, counter.prompt_tokens(WARMUP_MESSAGES, None), 4)
    drive.probe_requests, drive.ignore_eos_sent = await check_ignore_eos(client, url, cfg.endpoint, sample)
    if not drive.ignore_eos_sent:
        body.pop("ignore_eos", None)
    clock = monotonic_from(time.perf_counter())
    for i in range(cfg.arrivals.warmup_requests):
        rec = RequestRecord(index=i, scheduled_at=0.0, prompt_len=sample.prompt_len, max_tokens=4)
        drive.warmup.append(await send_streaming(client, url, cfg.endpoint, sample, rec, clock))
    stop_if_all_failed(drive.warmup)


async def _drive(cfg: MultiTurnConfig, url: str, model: str, counter: TokenCounter, context: int | None,
                 states: list[DialogState]) -> Drive:
    a = cfg.arrivals
    drive = Drive()
    async with make_client(cfg.endpoint, a.max_concurrency or max(1, len(states))) as client:
        await _warm_up(cfg, client, url, model, counter, drive)
        sender = TurnSender(client, url, cfg.endpoint, model, counter, monotonic_from(time.perf_counter()), context,
                            drive.ignore_eos_sent, cfg.output.save_text,
                            asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None)
        drive.turns = sender.records
        drive.started_unix = time.time()
        planned = sum(len(s.plan.turns) for s in states)
        with Progress(total=planned, desc=f"turns ({a.mode})", enabled=cfg.output.progress) as progress:
            sender.progress = progress
            try:
                if a.mode == "lockstep":
                    async def scrape(index: int) -> None:
                        series = await scrape_duet_series(cfg.scrape_metrics)
                        drive.round_metrics.append({"turn": index, "series": series})
                    if cfg.scrape_metrics:
                        await scrape(-1)
                    await run_lockstep(sender, states, a.duration_s, scrape if cfg.scrape_metrics else None)
                else:
                    timings = plan_timing([len(s.plan.turns) for s in states], a.conversation_rate, a.burstiness,
                                          a.think_time, random.Random(cfg.workload.seed + 2))
                    await run_staggered(sender, states, timings, a.duration_s)
            except asyncio.CancelledError:  # Ctrl-C: report what finished
                asyncio.current_task().uncancel()
                drive.interrupted = True
        for t in sender.records:
            if t.request.done_at is None:
                t.request.ok, t.request.done_at = False, sender.clock()
                t.request.error_kind = "interrupted"
    for s in states:
        s.end(INTERRUPTED)  # only those still going
    return drive


def _describe(cfg: MultiTurnConfig, model: str, base: str) -> str:
    w, a = cfg.workload, cfg.arrivals
    what = {
        "sharegpt": f"ShareGPT replay, {w.conversations} conversations"
                    + (f" of up to {w.max_turns} turns" if w.max_turns else ""),
        "synthetic": f"synthetic, {w.conversations} conversations x {w.max_turns} turns, own system prompt "
                     f"{w.system_len} + user {w.user_len} -> {w.output_len} tokens",
        "agentic": f"agentic, {w.conversations} sessions x {w.max_turns} turns, shared system prompt "
                   f"{w.system_len} tokens + {w.num_tools} tools, tool results ~{w.tool_output_len} -> "
                   f"{w.output_len} tokens",
    }[w.name]
    how = "lockstep" if a.mode == "lockstep" else (
        f"{format_rate(a.conversation_rate)} conversations/s, think {a.think_time.dist} mean {a.think_time.mean_s:g} s")
    label = f"{cfg.output.label}: " if cfg.output.label else ""
    return f"{label}{what}; {how}; model {model} at {base}"


def run_multiturn(cfg: MultiTurnConfig) -> int:
    if cfg.endpoint.api != "chat":
        raise SystemExit("multi-turn workloads use the chat API (--api chat)")
    base = api_base(cfg.endpoint.base_url)
    model = cfg.endpoint.model or discover_model(base, cfg.endpoint.http_headers)
    context = cfg.max_context_tokens
    if context is None:
        context = served_context_len(base, cfg.endpoint.http_headers, model)
    context = context or None  # 0: no limit
    say(f"loading tokenizer {cfg.tokenizer or '(Duet default model)'}")
    counter = TokenCounter(load_tokenizer(cfg.tokenizer))
    dialogs = build_dialogs(cfg.workload, counter, context)
    states = [DialogState.start(d) for d in dialogs]
    title = _describe(cfg, model, base)
    say(f"{title}\ncontext limit: {context or 'none'} tokens; sending to {base}/chat/completions")

    drive = asyncio.run(_drive(cfg, base + "/chat/completions", model, counter, context, states))
    if drive.interrupted:
        say("interrupted: reporting what was sent so far (unfinished turns count as 'interrupted')")
    count_output_tokens([t.request for t in drive.turns], counter, cfg.output.save_text)
    count_output_tokens(drive.warmup, counter, cfg.output.save_text)
    sent = Counter(t.conversation for t in drive.turns)
    outcomes = [DialogOutcome(s.plan.id, len(s.plan.turns), sent[s.plan.id], s.ended) for s in states]
    config = cfg.to_json()
    meta = {"label": cfg.output.label, "title": title, "base_url": base, "model": model, "tokenizer": cfg.tokenizer,
            "workload": cfg.workload.name, "mode": cfg.arrivals.mode,
            "conversation_rate": config["arrivals"]["conversation_rate"] if cfg.arrivals.mode == "poisson" else None,
            "max_context_tokens": context, "config": config,
            "requests_sent": drive.probe_requests + len(drive.warmup) + len(drive.turns),
            "probe_requests": drive.probe_requests, "ignore_eos_sent": drive.ignore_eos_sent,
            "interrupted": drive.interrupted, "started_unix": drive.started_unix}
    if drive.round_metrics:
        meta["round_metrics"] = drive.round_metrics
    result = MultiTurnResult(None, meta, drive.turns, outcomes, drive.warmup)
    summary = result.summary()
    table = render_turn_table(summary, title)
    print(table)
    out_dir = cfg.output.folder("multiturn-" + cfg.workload.name)
    write_result(out_dir / "results.json", result, summary)
    (out_dir / "report.txt").write_text(table + "\n")
    written = [out_dir / "results.json", out_dir / "report.txt"]
    if cfg.output.plots:
        from loadtest.multiturn.plots import plot_ttft_by_turn

        name = cfg.output.label or pathlib.PurePath(model).name
        written.append(plot_ttft_by_turn([(name, summary)], out_dir / "ttft_by_turn.png", title))
    say("wrote " + ", ".join(str(p) for p in written))
    if drive.interrupted:
        return 130
    return 0 if summary.overall.completed else 1
