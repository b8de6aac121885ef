"""Related probes (not in the checklist of loadtest/hostile/README.md): bodies cheap to send and
maybe dear to take. A huge `stop` list (every streamed piece is checked against every stop string
on the gateway's event loop); deeply nested JSON (`messages`, a schema): refused, not recursed."""
from __future__ import annotations

import json

from loadtest.hostile.client import chat_body, completion_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, all_of, client_error_json, health_ok


async def huge_stop_list(ctx: ProbeContext, r: ProbeResult) -> None:
    n = ctx.sizes.stop_strings
    stops = [f"zq{i:07d}" + "never-in-the-output-" * 2 for i in range(n)]
    body = completion_body(ctx.model, "Once upon a time", max_tokens=32, ignore_eos=True, stop=stops)
    r.record_reply(await ctx.server.post("/v1/completions", body, timeout_s=ctx.sizes.probe_timeout_s))
    r.details.update(stop_strings=n, body_bytes=len(json.dumps(body)))


def judge_stop(r: ProbeResult) -> tuple[bool | None, str]:
    return all_of(client_error_json(r, allowed=(200,)), health_ok(r))


def _raw_chat(ctx: ProbeContext, key: str, value_json: str) -> bytes:
    head = json.dumps(chat_body(ctx.model))[:-1]
    return f'{head}, "{key}": {value_json}}}'.encode()


async def deep_messages(ctx: ProbeContext, r: ProbeResult) -> None:
    depth = ctx.sizes.nesting_depth * 10
    head = json.dumps({"model": ctx.model, "max_tokens": 1})[:-1]
    raw = f'{head}, "messages": {"[" * depth}{"]" * depth}}}'.encode()
    r.record_reply(await ctx.server.post("/v1/chat/completions", raw=raw, timeout_s=20))
    r.details["depth"] = depth


async def deep_schema(ctx: ProbeContext, r: ProbeResult) -> None:
    depth = ctx.sizes.nesting_depth
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
    fmt = f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}'
    r.record_reply(await ctx.server.post("/v1/chat/completions", raw=_raw_chat(ctx, "response_format", fmt),
                                         timeout_s=20))
    r.details["depth"] = depth


PROBES = [
    Probe("huge_stop_list", "extra", "400 JSON or 200; /health p50<100 ms, max<1 s", huge_stop_list, judge_stop),
    Probe("deep_json_messages", "extra", "400 JSON", deep_messages, client_error_json, timeout_s=25.0),
    Probe("deep_json_schema", "extra", "400 JSON", deep_schema, client_error_json, timeout_s=25.0),
]
