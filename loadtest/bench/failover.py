"""The `failover` section: a decode worker SIGKILLed under load, and what its streams' move to
the other decode worker added (services/gateway/backends/migration.py).

Per --failover-modes mode, a fresh `duet up --planner off --prefill 1 --decode 2` (the model,
--up-arg and --worker-arg as the stack section's; on two GPUs prefill and decode-1 share GPU 0,
decode-0 has GPU 1, services/launcher/gpus.py):
- moved: the workers as configured; a moved stream's KV is rebuilt from what is held or moved
  (the prompt's pages from the prefill worker's cache), only the rest computed again;
- recomputed: every worker with --disable-prefix-cache, so a moved stream's prompt and the
  tokens it streamed are computed again from scratch, as a failover that replays does.

A few warm-up requests, then --failover-streams concurrent greedy streams (ignore_eos) of
distinct random prompts of --stack-lens tokens (token ids as the prompt). Once every stream has
--failover-after tokens, the decode worker running the most of them is SIGKILLed (`duet up`
restarts it); every stream runs to its end. Once the worker is back (or RESTART_DEADLINE_S passed:
the row says so), the same prompts run again unfaulted: a moved stream should equal its unfaulted
run. Streams moved: those the gateway's log names ("request <id>: ...; continuing ... elsewhere")."""
from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .failover_gaps import StreamTimes, failover_gaps, ms
from .measure import random_prompts
from .stack_metrics import metric_sum, ready_addresses, sample_sum, scrape, worker_metrics_address
from .stacks import stack_model, up_argv

SECTION = "failover"
# one gateway process: its counters (on the API port) and its log are the moves' record
LAYOUT = ["--planner", "off", "--prefill", "1", "--decode", "2", "--gateway-processes", "1"]
DECODE = ("decode-0", "decode-1")
MODES = {"moved": (), "recomputed": ("--disable-prefix-cache",)}  # the workers' extra flags
WARM_UP, WARM_UP_TOKENS = 4, 8  # concurrent requests before the measured run: both decode workers serve some
DEADLINE_S = 900.0  # for every stream of one run to end
RESTART_DEADLINE_S = 90.0  # for `duet up` to bring the killed worker back (else the unfaulted run goes on without it)
MOVED_LINE = re.compile(r"request (\S+): .*; continuing ")
REBUILT = ("held", "moved", "recomputed")


def failover(run) -> None:
    """Per mode: the worker killed and the streams it ran, streams moved and failed, the moved
    streams' longest inter-token gap (p50, max) beside the bystanders' and the ITL before the
    kill, the KV rebuilt by source, the streams equal to the unfaulted run."""
    from loadtest.duet_stack import DuetStack

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the stack
    folder, weights = stack_model(run)
    prompt_len, output = run.ints(run.args.stack_lens)
    vocab = _prompt_vocab(folder)
    prompts = random_prompts(vocab, [prompt_len] * run.args.failover_streams, seed=11)
    warm = random_prompts(vocab, [prompt_len] * WARM_UP, seed=12)
    for mode in run.names(run.args.failover_modes):
        if mode not in MODES:
            run.add(SECTION, f"{mode} FAILED", f"unknown mode; choose from {', '.join(MODES)}")
            continue
        argv = up_argv(run, LAYOUT, folder, weights, MODES[mode])
        t0 = time.monotonic()
        try:
            with DuetStack(argv, run.root / f"failover-{mode}" / "logs") as s:
                run.add(SECTION, f"{mode} ready_s", round(time.monotonic() - t0, 1), f"duet up {' '.join(argv)}")
                _measure(run, s, mode, prompts, warm, output)
        except Exception as e:  # noqa: BLE001 - the next mode still runs
            run.add(SECTION, f"{mode} FAILED", f"{type(e).__name__}: {str(e)[:160]}")


def _prompt_vocab(folder: Path) -> int:
    """Token ids every prompt may draw from: the gateway takes ids below its tokenizer's length."""
    import json

    from transformers import AutoTokenizer

    model_vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return min(model_vocab, len(AutoTokenizer.from_pretrained(str(folder))))


@dataclass
class Kill:
    """The decode worker running the most streams, SIGKILLed once every stream is `after` in."""

    up_pid: int
    log_dir: Path
    after: int
    worker: str = ""
    running: dict[str, float] = field(default_factory=dict)  # each decode worker's running requests
    at: float | None = None  # time.perf_counter() at the kill
    starts: int = 0  # the worker's ready lines before the kill

    async def watch(self, records) -> None:
        while not all(len(r.chunk_times) >= self.after or r.done_at is not None for r in records):
            await asyncio.sleep(0.005)
        if not all(r.done_at is not None for r in records):
            await asyncio.to_thread(self._kill)

    def _kill(self) -> None:
        from loadtest.duet_stack import live_child

        self.running = {w: metric_sum(worker_metrics_address(self.log_dir, w), "duet_running_requests")
                        for w in DECODE}
        self.worker = max(DECODE, key=lambda w: self.running[w])
        self.starts = len(ready_addresses(self.log_dir / f"{self.worker}.log"))
        live_child(self.up_pid, f"--worker-id {self.worker} ").kill()
        self.at = time.perf_counter()

    def wait_restarted(self) -> tuple[float | None, str]:
        """(seconds from the kill to its next ready line, ""), or (None, its log's last error)."""
        log = self.log_dir / f"{self.worker}.log"
        while len(ready_addresses(log)) <= self.starts:
            if time.perf_counter() - self.at > RESTART_DEADLINE_S:
                errors = [line for line in log.read_text(errors="replace").splitlines() if " ERROR " in line]
                return None, (errors[-1][-160:] if errors else "no error logged")
            time.sleep(0.2)
        return time.perf_counter() - self.at, ""


def _streams(url: str, model: str, prompts: list[list[int]], max_tokens: int, kill: Kill | None = None) -> list:
    """Every prompt streamed at once (greedy, ignore_eos), a RequestRecord each (perf_counter times)."""
    from loadtest.config import EndpointConfig
    from loadtest.endpoint import api_base
    from loadtest.records import RequestRecord
    from loadtest.sse_client import PreparedRequest, build_body, make_client, send_streaming

    # logprobs: a token with no text (random weights draw ids past the tokenizer) still comes as a chunk
    endpoint = EndpointConfig(url, api="completions", model=model, temperature=0.0, ignore_eos="on",
                              timeout_s=DEADLINE_S, extra_body={"logprobs": 0})
    records = [RequestRecord(i, 0.0, len(p), max_tokens) for i, p in enumerate(prompts)]

    async def main():
        async with make_client(endpoint, len(prompts)) as client:
            tasks = [asyncio.create_task(send_streaming(
                client, api_base(url) + endpoint.path, endpoint,
                PreparedRequest(build_body(endpoint, model, None, p, max_tokens), len(p), max_tokens), r,
                time.perf_counter)) for p, r in zip(prompts, records)]
            watch = asyncio.create_task(kill.watch(records)) if kill else None
            _, late = await asyncio.wait(tasks, timeout=DEADLINE_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            for r in records:
                if r.done_at is None:
                    r.ok, r.error_kind, r.done_at = False, "deadline", time.perf_counter()
            if watch is not None:
                await asyncio.wait_for(watch, 60)  # a kill under way ends; its errors are the run's

    asyncio.run(main())
    return records


def _counts(gateway: str) -> dict[str, float]:
    """The gateway's failover counters: moves, and KV rebuilt by source."""
    samples = scrape(gateway)
    found = {src: sample_sum(samples, "duet_migration_rebuilt_tokens_total", source=src) for src in REBUILT}
    return {**found, "migrations": sample_sum(samples, "duet_migrations_total")}


@dataclass
class Outcome:
    """One mode's two runs of the same prompts, and the gateway's counters over the faulted one."""

    faulted: list  # RequestRecord each
    unfaulted: list
    counted: dict[str, float]  # _counts' deltas
    faulted_s: float
    unfaulted_s: float
    restart_s: float | None  # the kill to the worker's next ready line (None: not back)
    restart_error: str = ""  # then, its last logged error


def _measure(run, stack, mode: str, prompts, warm, output: int) -> None:
    from loadtest.endpoint import api_base, discover_model

    model = discover_model(api_base(stack.url), {})
    if failed := [r for r in _streams(stack.url, model, warm, WARM_UP_TOKENS) if not r.ok]:
        raise RuntimeError(f"warm-up: {failed[0].error_kind} {failed[0].error_detail}")
    gateway = stack.url.removeprefix("http://")
    kill = Kill(stack.proc.pid, stack.log_dir, run.args.failover_after)
    before = _counts(gateway)
    t0 = time.perf_counter()
    faulted = _streams(stack.url, model, prompts, output, kill)
    faulted_s = time.perf_counter() - t0
    counted = {k: v - before[k] for k, v in _counts(gateway).items()}
    if kill.at is None:
        raise RuntimeError("every stream ended before the kill: raise --stack-lens' output or lower --failover-after")
    restart_s, restart_error = kill.wait_restarted()
    t0 = time.perf_counter()
    unfaulted = _streams(stack.url, model, prompts, output)
    _report(run, mode, stack.log_dir, kill,
            Outcome(faulted, unfaulted, counted, faulted_s, time.perf_counter() - t0, restart_s, restart_error))


def _report(run, mode: str, log_dir: Path, kill: Kill, o: Outcome) -> None:
    n = len(o.faulted)
    moved_ids = set(MOVED_LINE.findall((log_dir / "gateway.log").read_text(errors="replace")))
    moved = [r.ok and r.response_id in moved_ids for r in o.faulted]
    failed = [r for r in o.faulted if not r.ok]
    gaps = failover_gaps([StreamTimes(r.chunk_times, m) for r, m in zip(o.faulted, moved) if r.ok], kill.at)
    other = next(w for w in DECODE if w != kill.worker)
    run.add(SECTION, f"{mode} killed worker's streams", int(kill.running[kill.worker]),
            f"{kill.worker} SIGKILLed with this many running ({other}: {kill.running[other]:.0f}), every stream "
            f">= {kill.after} tokens in; " + (f"duet up restarted it in {o.restart_s:.1f}s" if o.restart_s is not None
                                              else f"NOT back {RESTART_DEADLINE_S:.0f}s later: {o.restart_error}"))
    run.add(SECTION, f"{mode} streams moved", sum(moved), f"of {n}: their ids in the gateway log's 'continuing "
            f"elsewhere' lines; duet_migrations_total +{o.counted['migrations']:.0f}")
    run.add(SECTION, f"{mode} streams failed", len(failed),
            f"first: {failed[0].error_kind} {(failed[0].error_detail or '')[:100]}" if failed else "")
    run.add(SECTION, f"{mode} moved longest gap p50 ms", ms(gaps.moved, 50), "each moved stream's longest "
            "inter-token gap: the kill noticed, the continuation routed, its KV rebuilt, its next token")
    run.add(SECTION, f"{mode} moved longest gap max ms", ms(gaps.moved, 100))
    run.add(SECTION, f"{mode} bystander longest gap p50 ms", ms(gaps.bystanders, 50),
            f"max {ms(gaps.bystanders, 100)} ms; the {len(gaps.bystanders)} streams not moved that streamed "
            f"through the kill")
    run.add(SECTION, f"{mode} ITL p50 ms before the kill", ms(gaps.before_kill, 50),
            f"p99 {ms(gaps.before_kill, 99)} ms; every stream's inter-token gaps before the kill")
    run.add(SECTION, f"{mode} KV rebuilt tokens held/moved/recomputed",
            "/".join(f"{o.counted[src]:.0f}" for src in REBUILT),
            "duet_migration_rebuilt_tokens_total over the faulted run: the moved streams' KV by where it came from")
    same = sum(f.ok and u.ok and (f.output_text, f.usage_completion_tokens) == (u.output_text, u.usage_completion_tokens)
               for f, u in zip(o.faulted, o.unfaulted))
    run.add(SECTION, f"{mode} == unfaulted sequences", f"{same}/{n}", "greedy text and token count against the same "
            f"prompts run again unfaulted ({sum(not u.ok for u in o.unfaulted)} of those failed); in bf16 other "
            "batch shapes may flip a near-tie")
    run.add(SECTION, f"{mode} faulted run s", round(o.faulted_s, 1), f"the unfaulted run {o.unfaulted_s:.1f}s")
