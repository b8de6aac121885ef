"""Checklist item 2: a JSON schema that is expensive for xgrammar, in each place one can come
in (response_format, a forced tool's parameters, the Responses API's text.format).

Compiling is allowed to be refused (400) or to succeed (200); what it must not do is stop
the gateway's event loop: /health keeps answering within the budget while it runs. Each
variant's pattern has its own length, so no compiled-grammar cache answers it."""
from __future__ import annotations

from loadtest.hostile.client import chat_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, all_of, client_error_json, health_ok

EXPECT = "400 JSON or 200; /health p50<100 ms, max<1 s while it compiles"


def _schema(repeat: int, nonce: str) -> dict:
    return {"type": "string", "pattern": f"[a-z]{{1,{repeat}}}", "description": nonce}


def _object_schema(repeat: int, nonce: str) -> dict:
    return {"type": "object", "properties": {"a": _schema(repeat, nonce)}, "required": ["a"]}


async def via_response_format(ctx: ProbeContext, r: ProbeResult) -> None:
    n = ctx.sizes.grammar_repeat
    body = chat_body(ctx.model, response_format={"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": _schema(n, ctx.nonce)}})
    r.record_reply(await ctx.server.post("/v1/chat/completions", body, timeout_s=ctx.sizes.probe_timeout_s))
    r.details["pattern_repeat"] = n


async def via_tools(ctx: ProbeContext, r: ProbeResult) -> None:
    n = ctx.sizes.grammar_repeat + 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": _object_schema(n, ctx.nonce)}}]
    body = chat_body(ctx.model, tools=tools, tool_choice="required")
    r.record_reply(await ctx.server.post("/v1/chat/completions", body, timeout_s=ctx.sizes.probe_timeout_s))
    r.details["pattern_repeat"] = n


async def via_responses(ctx: ProbeContext, r: ProbeResult) -> None:
    n = ctx.sizes.grammar_repeat + 2
    body = {"model": ctx.model, "input": "Say hi.", "max_output_tokens": 1, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": _object_schema(n, ctx.nonce)}}}
    r.record_reply(await ctx.server.post("/v1/responses", body, timeout_s=ctx.sizes.probe_timeout_s))
    r.details["pattern_repeat"] = n


def judge(r: ProbeResult) -> tuple[bool | None, str]:
    return all_of(client_error_json(r, allowed=(200,)), health_ok(r))


PROBES = [
    Probe("schema_response_format", "2", EXPECT, via_response_format, judge),
    Probe("schema_tools", "2", EXPECT, via_tools, judge),
    Probe("schema_responses_text_format", "2", EXPECT, via_responses, judge),
]
