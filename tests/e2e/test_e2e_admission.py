"""Admission and edge checks end to end, through `duet up` in both modes: split (1 prefill +
1 decode over gRPC) and colocated (1 `both` worker), default model, workers capped at 8
running requests, 64 MiB of KV each (~1440 tokens).

* A client's mistake is a 400 in OpenAI's error format naming the `param`, never a 500:
  integers past what the gRPC contract carries (top_k, n, max_tokens, top_logprobs,
  logit_bias keys, seed, stop_token_ids), logit_bias keys that are digits to Python but not
  to int(), Responses items whose content or output is a list of non-objects.
* What can never fit the largest live worker is a 400 at once (under 2 s), a whole prompt
  list included, before anything is sent; decode's Reserve says INVALID_ARGUMENT for it.
* Admission weighs work: a prompt list of 24 against a batch capacity of 8 does not starve
  another client's one-token request, and the list still completes.

One stack per mode for the whole module (each case is a single short request)."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.openai_schema import validate
from tests.helpers.stack import DuetUp, managed, new_log_dir

pytestmark = pytest.mark.slow

MODES = {"split": ("--prefill", "1", "--decode", "1"), "colocated": ("--both", "1", "--prefill", "0", "--decode", "0")}
BATCH = 8  # each worker's --max-running-requests: the gateway's sequence budget follows it
BIG = 2**40


@pytest.fixture(scope="module", params=list(MODES))
def stack(request):
    s = DuetUp(new_log_dir(f"admission-{request.param}"), *MODES[request.param],
               worker_args=["--max-running-requests", str(BATCH)])
    with managed(request, s.start()) as s:
        s.wait_ready()
        s.mode = request.param
        yield s


def _post(stack, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    base = stack.base_url.removesuffix("/v1")
    return httpx.post(base + path, json=body, timeout=timeout)  # no model: the one served


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **fields}


def _assert_400(response: httpx.Response, param: str, code: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    validate(body, "ErrorResponse")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body


CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
# hostile-client checklist item 3 (loadtest/hostile/README.md): (path, body, the param the 400 names)
OUT_OF_RANGE = [
    (CHAT, _chat(top_k=BIG), "top_k"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "n": BIG}, "n"),
    (CHAT, _chat(max_tokens=BIG), "max_tokens"),
    (CHAT, _chat(max_completion_tokens=BIG), "max_completion_tokens"),
    (CHAT, _chat(logprobs=True, top_logprobs=BIG), "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logprobs": BIG}, "logprobs"),
    (CHAT, _chat(logit_bias={str(BIG): 1}), "logit_bias"),
    (CHAT, _chat(logit_bias={"\u00b2": 1}), "logit_bias"),  # "²".isdigit() is True; int("²") fails
    (CHAT, _chat(logit_bias={"\u0663": 1}), "logit_bias"),  # Arabic-Indic 3: int() takes it, no token id
    (CHAT, _chat(logit_bias={"5": 1e300}), "logit_bias"),
    (CHAT, _chat(seed=2**64), "seed"),
    (CHAT, _chat(seed=-(2**63) - 1), "seed"),
    (CHAT, _chat(stop_token_ids=[2**31]), "stop_token_ids[0]"),
    (CHAT, _chat(repetition_penalty=1e39), "repetition_penalty"),
    (COMPLETIONS, {"prompt": [1, BIG], "max_tokens": 2}, "prompt"),
    (RESPONSES, {"input": "hi", "max_output_tokens": BIG}, "max_output_tokens"),
    (RESPONSES, {"input": [{"type": "message", "role": "user", "content": [1, 2]}]}, "input[0].content[0]"),
    (RESPONSES, {"input": [{"type": "message", "role": "user", "content": ["text"]}]}, "input[0].content[0]"),
    (RESPONSES, {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c1", "output": [None]}]},
     "input[1].output[0]"),
    (RESPONSES, {"input": [{"type": "function_call", "call_id": "c1", "name": 5, "arguments": "{}"}]},
     "input[0].name"),
]


def test_out_of_range_fields_are_a_400_naming_the_param(stack):
    for path, body, param in OUT_OF_RANGE:
        _assert_400(_post(stack, path, body), param)
    ok = _post(stack, CHAT, _chat(seed=-1, top_k=2**31 - 1, logit_bias={"5": -100}, stop_token_ids=[2**31 - 1]))
    assert ok.status_code == 200, ok.text  # the edges of each range still serve
    assert stack.gateway_metrics().value("duet_requests_total", status="500") == 0


def test_what_can_never_fit_is_a_400_at_once(stack):
    cases = [  # checklist item 7: n 128 x 2048 tokens; a list of 1024 prompts none of which fits
        (CHAT, _chat(n=128, max_tokens=2048), "max_tokens"),
        (COMPLETIONS, {"prompt": [[1, 2, 3]] * 1024, "max_tokens": 2000}, "max_tokens"),
    ]
    for path, body, param in cases:
        started = time.monotonic()
        error = _assert_400(_post(stack, path, body), param, "kv_capacity_exceeded")
        assert time.monotonic() - started < 2, time.monotonic() - started
        assert "tokens of KV" in error["error"]["message"]
    assert stack.gateway_metrics().value("duet_requests_total", status="429") == 0
    if stack.mode == "split":  # the worker answers the same rule: INVALID_ARGUMENT, not RESOURCE_EXHAUSTED
        async def reserve():
            async with stack.worker_channel("decode-0", "decode", aio=True) as channel:  # as the gateway
                stub = duet_pb2_grpc.DecodeStub(channel)
                await stub.Reserve(duet_pb2.ReserveRequest(request_id="never-fits", prompt_tokens=10,
                                                           max_tokens=2048, n=128, prefill_worker_id="prefill-0"),
                                   timeout=10)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(reserve())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert time.monotonic() - started < 2
    stack.wait_idle()


def test_a_prompt_list_does_not_starve_a_one_token_request(stack):
    """Checklist item 5, scaled to the CPU: 24 prompts x 16 tokens against a batch of 8 (the
    list runs 4 at a time: --max-request-share 0.5), and a one-token request sent meanwhile."""
    async def go():
        async with httpx.AsyncClient(base_url=stack.base_url.removesuffix("/v1"), timeout=300) as http:
            big_started = time.monotonic()
            big = asyncio.create_task(http.post(COMPLETIONS, json={
                "prompt": [f"Story {i}: once upon a time" for i in range(24)], "max_tokens": 16,
                "ignore_eos": True, "temperature": 0}))
            await asyncio.sleep(2.0)  # the list is running (and its rest waiting)
            started = time.monotonic()
            victim = await http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})
            victim_s = time.monotonic() - started
            big = await big
            return big, victim, victim_s, time.monotonic() - big_started
    big, victim, victim_s, big_s = asyncio.run(go())
    print(f"\n{stack.mode}: one-token request {victim_s:.1f} s while a 24-prompt list took {big_s:.1f} s")
    assert victim.status_code == 200, victim.text
    assert victim_s < 30, victim_s
    assert big.status_code in (200, 429), big.text  # completes, or is refused cleanly
    if big.status_code == 200:
        assert len(big.json()["choices"]) == 24
        assert all(c["finish_reason"] == "length" for c in big.json()["choices"])
    stack.wait_idle()
