"""Checklist item 6: a client that goes away must take its work with it. Ten ~1100-token
completions, dropped 50 ms, 100 ms, ... 500 ms after sending (where a drop lands in the request's
path depends on the machine, so they are spread over it); then the decode workers'
`duet_kv_cache_usage_ratio`, read every 250 ms, must be back at 0 within a few seconds (once
seen held for ~40 s in split mode)."""
from __future__ import annotations

import asyncio

import httpx

from loadtest.hostile.client import completion_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult

KV_FREE_WITHIN_S = 3.0


async def drop_after_send(ctx: ProbeContext, r: ProbeResult) -> None:
    s = ctx.sizes
    kv = ctx.kv if ctx.kv is not None and ctx.kv.addresses else None
    if kv is None:
        r.details["kv"] = "no decode worker /metrics known (pass --worker-metrics or --redis-url)"
    else:
        async with httpx.AsyncClient() as http:
            r.details["kv_before"] = await kv.usage(http)
    words = " hello" * s.disconnect_prompt_words

    async def one(i: int):
        body = completion_body(ctx.model, f"Request {i}:{words}", max_tokens=64, ignore_eos=True)
        try:
            return await asyncio.wait_for(ctx.server.post("/v1/completions", body, timeout_s=60),
                                          s.disconnect_after_s + i * s.disconnect_stagger_s)
        except asyncio.TimeoutError:
            return None  # cancelled: httpx closes the connection

    replies = await asyncio.gather(*(one(i) for i in range(s.disconnect_requests)))
    answered = [x.status for x in replies if x is not None]
    r.status = "client closed" if not answered else f"{len(answered)} answered"
    last = s.disconnect_after_s + (s.disconnect_requests - 1) * s.disconnect_stagger_s
    r.details.update(requests=s.disconnect_requests, dropped_after_s=[s.disconnect_after_s, round(last, 3)],
                     answered=answered)
    if kv is None:
        return
    watch_s = max(1.0, min(s.kv_watch_s, s.probe_timeout_s - 2))
    r.kv_trace, r.kv_zero_after_s = await kv.trace(watch_s=watch_s)
    r.details.update(kv_peak=max((v for _, v in r.kv_trace), default=None), kv_watch_s=watch_s)
    if kv.errors:
        r.details["kv_errors"] = kv.errors[-3:]


def judge(r: ProbeResult) -> tuple[bool | None, str]:
    if not r.kv_trace:
        return None, "KV usage not measured"
    before = r.details.get("kv_before") or 0.0
    if r.kv_zero_after_s is None:
        last = r.kv_trace[-1][1]
        was = f"; {before:.3f} before the probe, an earlier one's leftovers" if before else ""
        if last > before:
            return False, f"decode KV still {last:.3f} after {r.details.get('kv_watch_s')} s " \
                          f"(peak {r.details.get('kv_peak'):.3f}{was})"
        return None, f"decode KV back to {last:.3f}, where it was before the probe (an earlier one's leftovers)"
    if r.kv_zero_after_s > KV_FREE_WITHIN_S:
        return False, f"decode KV back to 0 only after {r.kv_zero_after_s:.1f} s (want < {KV_FREE_WITHIN_S:.0f} s)"
    if r.details.get("kv_peak", 0) == 0:
        return True, f"decode KV read 0 at every sample ({len(r.kv_trace)}, from the disconnect on)"
    return True, f"decode KV back to 0 after {r.kv_zero_after_s:.1f} s"


PROBES = [Probe("disconnect_x10_staggered", "6", f"decode KV back to 0 within {KV_FREE_WITHIN_S:.0f} s", drop_after_send,
                judge, timeout_s=35.0)]
