"""Drive one run at one arrival pattern: warm-up, paced sends, drain."""
from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from loadtest.config import EndpointConfig
from loadtest.progress import Progress
from loadtest.records import RequestRecord
from loadtest.sse_client import PreparedRequest, monotonic_from, send_streaming


@dataclass
class RunResult:
    label: str
    request_rate: float  # inf when unpaced; nan for a trace replay
    records: list[RequestRecord]
    started_unix: float
    warmup: list[RequestRecord] = field(default_factory=list)


@dataclass
class RateRun:
    """What one paced run needs; `count` and `duration_s` bound it (either or both)."""

    client: httpx.AsyncClient
    url: str
    endpoint: EndpointConfig
    prepared: list[PreparedRequest]
    send_times: Iterator[float]
    count: int | None
    duration_s: float | None
    max_concurrency: int | None
    drain_timeout_s: float
    progress: bool = True
    desc: str = "requests"


@dataclass
class PacedOutcome:
    records: list[RequestRecord]
    interrupted: bool = False  # Ctrl-C: sending stopped, in-flight requests were dropped


async def run_paced(run: RateRun) -> PacedOutcome:
    clock = monotonic_from(time.perf_counter())
    gate = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    interrupted = False
    with Progress(total=run.count, desc=run.desc, enabled=run.progress) as progress:

        async def one(rec: RequestRecord, prep: PreparedRequest) -> None:
            progress.started()
            try:
                await send_streaming(run.client, run.url, run.endpoint, prep, rec, clock)
            finally:
                if gate is not None:
                    gate.release()
                progress.finished(rec.ok)

        try:
            for i, at in enumerate(run.send_times):
                if run.count is not None and i >= run.count:
                    break
                if run.duration_s is not None and at >= run.duration_s:
                    break
                delay = at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if gate is not None:
                    await gate.acquire()  # a closed loop: the next send waits for a free slot
                if run.duration_s is not None and clock() >= run.duration_s:
                    if gate is not None:
                        gate.release()
                    break
                prep = run.prepared[i % len(run.prepared)]
                rec = RequestRecord(index=i, scheduled_at=at, prompt_len=prep.prompt_len, max_tokens=prep.max_tokens,
                                    model=prep.body.get("model"))
                records.append(rec)
                tasks.append(asyncio.create_task(one(rec, prep)))

            await _drain(tasks, run.drain_timeout_s if run.duration_s is not None else None)
        except asyncio.CancelledError:
            # Ctrl-C: keep what finished so the run still gets a report.
            interrupted = True
            asyncio.current_task().uncancel()
            await _drain(tasks, 0)
    for rec in records:
        if rec.done_at is None:  # cut off by the drain deadline, or by Ctrl-C
            rec.ok, rec.done_at = False, clock()
            rec.error_kind = "interrupted" if interrupted else "cancelled_at_end"
    return PacedOutcome(records, interrupted)


async def _drain(tasks: list[asyncio.Task], timeout_s: float | None) -> None:
    """Wait for the tasks up to timeout_s (None: no limit, 0: not at all), cancel the rest."""
    if not tasks:
        return
    pending = set(tasks)
    if timeout_s != 0:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def warm_up(client: httpx.AsyncClient, url: str, endpoint: EndpointConfig, prepared: list[PreparedRequest],
                  n: int, max_concurrency: int | None, progress: bool) -> list[RequestRecord]:
    """A few requests before measuring (connections, lazy model loading, caches)."""
    if n <= 0:
        return []
    run = RateRun(client, url, endpoint, prepared, itertools.repeat(0.0), n, None, max_concurrency, math.inf,
                  progress, "warm-up")
    outcome = await run_paced(run)
    if outcome.interrupted:
        raise asyncio.CancelledError  # nothing measured yet: let Ctrl-C end the program
    return outcome.records


def stop_if_all_failed(warmup: list[RequestRecord]) -> None:
    if warmup and not any(r.ok for r in warmup):
        raise SystemExit(f"warm-up failed: {warmup[0].error_kind}: {warmup[0].error_detail}")


async def check_ignore_eos(client: httpx.AsyncClient, url: str, endpoint: EndpointConfig,
                           sample: PreparedRequest) -> tuple[int, bool]:
    """(probe requests sent, whether to send ignore_eos). auto: one tiny request with it, and
    the field is dropped when the server refuses it (400/422 naming it)."""
    if endpoint.ignore_eos != "auto":
        return 0, endpoint.ignore_eos == "on"
    probe = PreparedRequest({**sample.body, "max_tokens": 1, "ignore_eos": True}, sample.prompt_len, 1)
    rec = RequestRecord(index=-1, scheduled_at=0.0, prompt_len=sample.prompt_len, max_tokens=1)
    await send_streaming(client, url, endpoint, probe, rec, monotonic_from(time.perf_counter()))
    if rec.http_status in (400, 422) and "ignore_eos" in (rec.error_detail or ""):
        say("server rejects ignore_eos: sending without it, so outputs may end before max_tokens")
        return 1, False
    return 1, True


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
