"""Checklist item 7: what can never fit is a 400 at once; what fits later waits or is served.
n=128 x max_tokens=2048 needs more KV than a worker has: 400 at once (not a 429, which tells the
client to retry what never succeeds); a 1024-prompt list fits piece by piece: 200 (or a 400
naming a documented limit), not a 429 after a long wait."""
from __future__ import annotations

from loadtest.hostile.client import chat_body, completion_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, client_error_json


async def never_fits(ctx: ProbeContext, r: ProbeResult) -> None:
    s = ctx.sizes
    body = chat_body(ctx.model, n=s.never_fit_n, max_tokens=s.never_fit_max_tokens, ignore_eos=True,
                     temperature=1.0)
    r.record_reply(await ctx.server.post("/v1/chat/completions", body, timeout_s=s.probe_timeout_s))
    r.details.update(n=s.never_fit_n, max_tokens=s.never_fit_max_tokens)


def judge_never(r: ProbeResult) -> tuple[bool | None, str]:
    if r.status == 429:
        return False, f"429 after {r.latency_s:.1f} s: a retry can never succeed (want 400)"
    ok, why = client_error_json(r)
    if ok and (r.latency_s or 0) > 2.0:
        return False, f"{why}, but after {r.latency_s:.1f} s (want at once, < 2 s)"
    return ok, why


async def big_list(ctx: ProbeContext, r: ProbeResult) -> None:
    s = ctx.sizes
    prompts = [f"Prompt {i}: the sea is" for i in range(s.big_list_prompts)]
    body = completion_body(ctx.model, prompts, max_tokens=16)
    r.record_reply(await ctx.server.post("/v1/completions", body, timeout_s=s.probe_timeout_s - 1))
    r.details["prompts"] = s.big_list_prompts


def judge_list(r: ProbeResult) -> tuple[bool | None, str]:
    if r.status == "timeout":
        return None, "no answer within the probe's time (still working is not the 429 the checklist asks for)"
    if r.status == 429:
        return False, f"429 after {r.latency_s:.1f} s for work that fits piece by piece"
    return client_error_json(r, allowed=(200,))


PROBES = [
    Probe("never_fits_n128_x_2048", "7", "400 JSON at once (<2 s), not 429", never_fits, judge_never),
    Probe("prompt_list_1024", "7", "200, or 400 JSON naming a limit; not 429", big_list, judge_list),
]
