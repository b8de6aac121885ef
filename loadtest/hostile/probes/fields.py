"""Checklist item 3: a client's mistake must be a 4xx with OpenAI error JSON, never a 500.

Integers past what the gRPC contract carries (int32 / uint64 fields), logit_bias keys that
Python calls digits but int() refuses (superscripts), Responses input items whose content
or output is a list of non-objects, and a few neighbours of these."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loadtest.hostile.client import chat_body, completion_body
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import ProbeResult, client_error_json

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BIG = 2**40


def _responses(model: str, **extra) -> dict:
    return {"model": model, "max_output_tokens": 1, "temperature": 0, **extra}


# name -> (path, body from the model name (a dict, or bytes sent as they are), also-acceptable statuses)
Case = tuple[str, Callable[[str], Any], tuple[int, ...]]
CASES: dict[str, Case] = {
    "top_k_2^40": (CHAT, lambda m: chat_body(m, top_k=BIG), ()),
    "n_2^40": (CHAT, lambda m: chat_body(m, n=BIG), ()),
    "max_tokens_2^40": (COMPLETIONS, lambda m: completion_body(m, max_tokens=BIG), ()),
    "max_completion_tokens_2^40": (CHAT, lambda m: chat_body(m, max_completion_tokens=BIG), ()),
    "seed_2^64": (CHAT, lambda m: chat_body(m, seed=2**64), ()),
    "seed_negative": (CHAT, lambda m: chat_body(m, seed=-1), (200,)),  # vLLM takes any int64
    "seed_2^64-1_n2": (CHAT, lambda m: chat_body(m, seed=2**64 - 1, n=2), (200,)),  # sequence i uses seed + i
    "seed_2^63_n2": (CHAT, lambda m: chat_body(m, seed=2**63 - 1, n=2), (200,)),
    "top_logprobs_2^40": (CHAT, lambda m: chat_body(m, logprobs=True, top_logprobs=BIG), ()),
    "logprobs_2^40": (COMPLETIONS, lambda m: completion_body(m, logprobs=BIG), ()),
    "stop_token_ids_2^40": (CHAT, lambda m: chat_body(m, stop_token_ids=[BIG]), ()),
    "prompt_token_id_2^40": (COMPLETIONS, lambda m: completion_body(m, prompt=[1, BIG]), ()),
    "logit_bias_superscript_key": (CHAT, lambda m: chat_body(m, logit_bias={"\u00b2": 1}), ()),
    "logit_bias_key_2^40": (CHAT, lambda m: chat_body(m, logit_bias={str(BIG): 1}), ()),
    "logit_bias_key_out_of_vocab": (CHAT, lambda m: chat_body(m, logit_bias={"1000000000": 1}), ()),
    "integer_5000_digits": (CHAT, lambda m: json.dumps(chat_body(m))[:-1].encode() + b', "top_k": 1'
                            + b"0" * 5000 + b"}", ()),
    "temperature_nan": (CHAT, lambda m: json.dumps(chat_body(m))[:-1].encode() + b', "temperature": NaN}', ()),
    "responses_content_list_of_ints": (RESPONSES, lambda m: _responses(
        m, input=[{"role": "user", "content": [1, 2]}]), ()),
    "responses_output_list_of_ints": (RESPONSES, lambda m: _responses(m, input=[
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [1, "x"]}]), ()),
    "responses_input_list_of_strings": (RESPONSES, lambda m: _responses(m, input=["hi", "there"]), ()),
    "responses_max_output_tokens_2^40": (RESPONSES, lambda m: _responses(m, input="hi", max_output_tokens=BIG), ()),
    "chat_content_list_of_ints": (CHAT, lambda m: {**chat_body(m), "messages": [{"role": "user", "content": [1]}]},
                                  ()),
}


def _case_probe(name: str, case: Case) -> Probe:
    path, make_body, allowed = case

    async def run(ctx: ProbeContext, r: ProbeResult) -> None:
        body = make_body(ctx.model)
        raw = body if isinstance(body, bytes) else None
        r.record_reply(await ctx.server.post(path, None if raw else body, raw=raw, timeout_s=20))
        r.details["path"] = path

    expect = "400 JSON" + (" (or " + "/".join(map(str, allowed)) + ")" if allowed else "")
    return Probe(f"field_{name}", "3", expect, run, lambda r: client_error_json(r, allowed), timeout_s=25.0)


PROBES = [_case_probe(name, case) for name, case in CASES.items()]
