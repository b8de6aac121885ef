"""Failure rules on one prefill/decode pair (separate processes, a real redis-server the
test can stop): a client that disconnects mid-stream or mid-prefill cancels the work on
every pod; Redis briefly down leaves serving up on the last known worker set. After
each, used pages return to zero and no request is left running. The rules and the other
tests that prove them: docs/ARCHITECTURE.md, "Failure rules"."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers.stack import ProcessStack, http_status, managed, model_dir, new_log_dir, wait_until

LONG_PROMPT = " ".join(f"item {i} is a small grey pebble;" for i in range(160))  # ~1300 tokens
CHUNK = 16  # prefill token budget per step: a long prompt takes many steps


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("fail-pair"), registry_ttl_s=4.0, kv_cache_memory="160M",
                     worker_args=["--max-num-batched-tokens", str(CHUNK)])
    with managed(request, s.start(prefill=1, decode=1)) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def model(stack):
    return stack.client().models.list().data[0].id


def prompt_tokens(text: str) -> int:
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(str(model_dir())).encode(text))


def snapshot(stack, worker, name, **labels) -> float:
    return stack.metrics(worker).value(name, **labels)


def test_disconnect_mid_stream_drops_the_request_on_decode(stack, model):
    before_decode = snapshot(stack, "decode-0", "duet_engine_tokens_computed_total", phase="decode")
    before_cancel = snapshot(stack, "decode-0", "duet_requests_total", outcome="cancelled")
    client = stack.client()
    stream = client.completions.create(model=model, prompt="Count slowly: one, two,", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += sum(len(c.text) > 0 for c in chunk.choices)
        if got >= 3:
            break
    assert snapshot(stack, "decode-0", "duet_running_requests") >= 0  # decode is reachable
    stream.close()  # the client goes away mid-stream
    stack.wait_idle(["prefill-0", "decode-0"], timeout=20)
    wait_until(lambda: snapshot(stack, "decode-0", "duet_requests_total", outcome="cancelled") > before_cancel,
               10, "decode to count the request as cancelled")
    computed = snapshot(stack, "decode-0", "duet_engine_tokens_computed_total", phase="decode") - before_decode
    assert 2 <= computed < 300, computed  # stopped long before max_tokens
    time.sleep(1.0)  # and stays stopped
    assert snapshot(stack, "decode-0", "duet_engine_tokens_computed_total", phase="decode") - before_decode \
        == computed
    status = stack.gateway_metrics()
    assert status.value("duet_requests_total", service="gateway", outcome="cancelled", status="499") >= 1


def test_disconnect_during_prefill_stops_prefill_and_frees_the_reservation(stack, model):
    before = snapshot(stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill")
    before_generate = snapshot(stack, "decode-0", "duet_requests_total")

    async def go():
        async with stack.async_client() as client:
            task = asyncio.create_task(client.completions.create(
                model=model, prompt=LONG_PROMPT, max_tokens=8, temperature=0, stream=True))
            # prefill is under way once it has computed some of the prompt
            await asyncio.to_thread(wait_until, lambda: snapshot(
                stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill") - before >= 4 * CHUNK,
                60, "prefill to start computing the long prompt", 0.05)
            assert stack.kv_usage("decode-0") > 0  # decode reserved the pages
            task.cancel()  # the client goes away before its first token
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(go())
    stack.wait_idle(["prefill-0", "decode-0"], timeout=20)
    computed = snapshot(stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill") - before
    time.sleep(1.0)  # and stays stopped
    assert snapshot(stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill") - before == computed
    assert computed < prompt_tokens(LONG_PROMPT) - 2 * CHUNK, computed  # stopped well before the end
    # decode never started generating: its reservation was cancelled and freed
    assert snapshot(stack, "decode-0", "duet_requests_total") == before_generate


def test_gateway_killed_mid_request_leaves_no_work_on_the_pods(stack, model):
    """The gateway dies (SIGKILL) while prefill computes a long prompt: its RPCs break,
    prefill stops, and decode frees the reservation nobody will claim. A new gateway then
    serves as before."""
    before = snapshot(stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill")

    async def go():
        async with stack.async_client() as client:
            task = asyncio.create_task(client.completions.create(
                model=model, prompt=LONG_PROMPT + " gateway", max_tokens=8, temperature=0, stream=True))
            await asyncio.to_thread(wait_until, lambda: snapshot(
                stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill") - before >= 4 * CHUNK,
                60, "prefill to start computing the long prompt", 0.05)
            assert stack.kv_usage("decode-0") > 0
            stack.kill("gateway")
            with pytest.raises(Exception):
                await task
    asyncio.run(go())
    stack.wait_idle(["prefill-0", "decode-0"], timeout=40)
    computed = snapshot(stack, "prefill-0", "duet_engine_tokens_computed_total", phase="prefill") - before
    assert computed < prompt_tokens(LONG_PROMPT) - 2 * CHUNK, computed
    stack.start_gateway()
    wait_until(lambda: http_status(stack.health_url) == 200, 60, "the new gateway")
    r = stack.client().completions.create(model=model, prompt="The capital of Spain is", max_tokens=4,
                                          temperature=0)
    assert r.usage.completion_tokens >= 1
    stack.wait_idle(["prefill-0", "decode-0"], timeout=20)


def test_redis_briefly_down_keeps_serving_on_the_last_known_workers(stack, model):
    client = stack.client()

    def ask() -> str:
        r = client.completions.create(model=model, prompt="The capital of Spain is", max_tokens=6, temperature=0)
        return r.choices[0].text
    expected = ask()  # also warms the pair: prefill holds decode's NIXL metadata
    stack.redis_server.stop()
    try:
        time.sleep(5.0)  # longer than the registry TTL: entries would have expired
        for _ in range(2):
            assert ask() == expected
        assert http_status(stack.health_url) == 200
    finally:
        stack.redis_server.start()  # empty: the workers register again at their next heartbeat
    for _ in range(3):  # right after the restart, before and while they re-register
        assert ask() == expected
    stack.wait_registered(["prefill-0", "decode-0"], timeout=30)
    assert ask() == expected
    stack.wait_idle(["prefill-0", "decode-0"], timeout=20)


def test_without_a_prefill_worker_the_decode_worker_prefills_itself(stack, model):
    """Last (it kills the pair's prefill): once the dead prefill worker's TTL passes, the router
    places every request on the decode worker alone, which prefills the whole prompt itself
    (as while a same-host prefill worker restarts: services/worker_runtime/peer_memory_exit.py),
    /health stays 200, the greedy answer is the split one, and the decode worker holds nothing
    after."""
    def ask() -> str:
        return stack.client().completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                                 temperature=0).choices[0].text

    split = ask()
    stack.kill("prefill-0")
    wait_until(lambda: "prefill-0" not in stack.workers(), 15, "prefill-0 to leave the registry")
    assert http_status(stack.health_url) == 200
    assert ask() == split
    stack.wait_idle(["decode-0"], timeout=10)
