"""Checklist item 1: Jinja from the client through `chat_template_kwargs.chat_template`.

Nothing a client sends may be code: the model's own template must render the prompt, and a
client's template must be refused (400) or ignored, never run (it replaces the prompt, and
inside the gateway it can allocate gigabytes or loop for minutes)."""
from __future__ import annotations

import asyncio

from loadtest.hostile.client import chat_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, all_of, client_error_json, health_ok, rss_ok

CHAT = "/v1/chat/completions"


def _with_template(ctx: ProbeContext, template: str) -> dict:
    return chat_body(ctx.model, chat_template_kwargs={"chat_template": f"{{# {ctx.nonce} #}}{template}"})


async def template_override(ctx: ProbeContext, r: ProbeResult) -> None:
    baseline = await ctx.server.post(CHAT, chat_body(ctx.model), timeout_s=20)
    reply = await ctx.server.post(CHAT, _with_template(ctx, "{{ 7*7 }} PWNED"), timeout_s=20)
    r.record_reply(reply)
    r.details.update(baseline_status=baseline.status, baseline_prompt_tokens=baseline.prompt_tokens,
                     attack_prompt_tokens=reply.prompt_tokens)


def judge_override(r: ProbeResult) -> tuple[bool | None, str]:
    if r.status == 200:
        base, attack = r.details.get("baseline_prompt_tokens"), r.details.get("attack_prompt_tokens")
        if base is None or attack is None:
            return None, "200 but no usage to compare with the model's template"
        if base != attack:
            return False, f"200: the client's template rendered the prompt ({attack} prompt tokens, " \
                          f"the model's template gives {base})"
        return True, "200 with the model's own template (the client's was ignored)"
    return client_error_json(r)


async def memory_bomb(ctx: ProbeContext, r: ProbeResult) -> None:
    steps = []
    r.details["steps"] = steps
    for mb in ctx.sizes.bomb_steps_mb:
        if ctx.abort.is_set():
            break
        template = f'{{% set s = "x" * {mb * 1_000_000} %}}{{{{ s|length }}}}'
        reply = await ctx.server.post(CHAT, _with_template(ctx, template), timeout_s=ctx.sizes.probe_timeout_s)
        r.record_reply(reply)
        steps.append({"mb": mb, "status": reply.status, "latency_s": round(reply.latency_s, 3),
                      "rss_mb": ctx.gateway.rss_mb() if ctx.gateway else None})
        if isinstance(reply.status, int) and 400 <= reply.status < 500:
            break  # refused: bigger ones would be too


def judge_bomb(r: ProbeResult) -> tuple[bool | None, str]:
    if r.aborted:
        return False, f"cut short: {r.aborted}"
    return all_of(client_error_json(r), rss_ok(r, 100.0))


async def cpu_burn(ctx: ProbeContext, r: ProbeResult) -> None:
    n = ctx.sizes.jinja_loop
    loops = f"{{% for i in range({n}) %}}{{% for j in range({n}) %}}{{% endfor %}}{{% endfor %}}"
    # a distinct template each (a comment), so no cache answers the second one
    bodies = [_with_template(ctx, f"{{# {k} #}}{loops}done") for k in range(ctx.sizes.jinja_concurrency)]
    replies = await asyncio.gather(*(ctx.server.post(CHAT, b, timeout_s=ctx.sizes.probe_timeout_s)
                                     for b in bodies))
    slowest = max(replies, key=lambda x: x.latency_s)
    r.record_reply(slowest)
    r.details.update(loop_steps=n * n, statuses=[x.status for x in replies],
                     latencies_s=[round(x.latency_s, 3) for x in replies])


def judge_burn(r: ProbeResult) -> tuple[bool | None, str]:
    fast = (r.latency_s or 0) < 2.0, f"answered in {r.latency_s:.1f} s (want < 2 s)"
    return all_of(client_error_json(r), fast, health_ok(r))


PROBES = [
    Probe("jinja_template_override", "1", "400 JSON, or 200 rendered by the model's own template",
          template_override, judge_override),
    Probe("jinja_memory_bomb", "1", "400 JSON; gateway RSS +<100 MB (steps up to the RSS cap)",
          memory_bomb, judge_bomb),
    Probe("jinja_cpu_burn", "1", "400 JSON in <2 s; /health p50<100 ms, max<1 s", cpu_burn, judge_burn),
]
