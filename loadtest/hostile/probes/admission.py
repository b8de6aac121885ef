"""Checklist item 5: admission must weigh work (sequences x tokens), not HTTP requests.

One client sends a completions request with a long prompt list x max_tokens; another
client's 1-token request, sent while it runs, must still be served about as fast as on an
idle server (its latency is compared with the same request's just before)."""
from __future__ import annotations

import asyncio

from loadtest.hostile.client import completion_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult

VICTIM_BUDGET_S = 2.0  # or 4x its idle latency, whichever is larger


async def prompt_list_vs_victim(ctx: ProbeContext, r: ProbeResult) -> None:
    s = ctx.sizes
    victim_body = completion_body(ctx.model, "The capital of France is")
    idle = await ctx.server.post("/v1/completions", victim_body, timeout_s=10)
    prompts = [f"Story {i}: once upon a time" for i in range(s.admission_prompts)]
    attack_body = completion_body(ctx.model, prompts, max_tokens=s.admission_tokens, ignore_eos=True)
    attack = asyncio.create_task(ctx.server.post("/v1/completions", attack_body, timeout_s=s.probe_timeout_s))
    try:
        await asyncio.sleep(s.victim_lead_s)
        victim = await ctx.server.post("/v1/completions", victim_body,
                                       timeout_s=max(1.0, s.probe_timeout_s - s.victim_lead_s - 3))
    finally:
        attack_done = attack.done()
        if not attack_done:
            attack.cancel()  # the client goes away; the server should drop its work
        attack_reply = (await asyncio.gather(attack, return_exceptions=True))[0]
    r.record_reply(victim)
    r.victim_ms, r.victim_status = victim.latency_s * 1000, victim.status
    r.details.update(victim_idle_ms=round(idle.latency_s * 1000, 1), victim_idle_status=idle.status,
                     attack=f"{s.admission_prompts} prompts x {s.admission_tokens} tokens",
                     attack_status=attack_reply.status if attack_done else "still running (cancelled)",
                     attack_latency_s=round(attack_reply.latency_s, 2) if attack_done else None)


def judge(r: ProbeResult) -> tuple[bool | None, str]:
    idle_ms = r.details.get("victim_idle_ms")
    if r.details.get("victim_idle_status") != 200 or idle_ms is None:
        return None, f"the idle request failed ({r.details.get('victim_idle_status')})"
    budget_ms = max(VICTIM_BUDGET_S * 1000, 4 * idle_ms)
    if r.victim_status != 200:
        return False, f"victim got {r.victim_status} after {r.victim_ms:.0f} ms"
    if r.victim_ms > budget_ms:
        return False, f"victim waited {r.victim_ms:.0f} ms (idle {idle_ms:.0f} ms; want < {budget_ms:.0f})"
    return True, f"victim {r.victim_ms:.0f} ms (idle {idle_ms:.0f} ms)"


PROBES = [Probe("admission_prompt_list_vs_victim", "5",
                "victim's 1-token request 200 in <max(2 s, 4x idle)", prompt_list_vs_victim, judge)]
