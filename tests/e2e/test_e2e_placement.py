"""Placement by predicted latency through real processes: redis, the router, a prefill and a
decode worker (gRPC, KV over NIXL), the gateway, the official openai client.

A conversation's second turn, which the decode worker mostly holds (its first prompt and the
answer it decoded), is prefilled by the decode worker itself while it is idle. With streams
decoding there, the same turn goes through the prefill worker instead: the router's target
(`--slo-itl-ms 1`, below any step this CPU takes) makes every step with running rows pass it,
so local prefill would slow them. The answer is the same either way (greedy). The threshold
rule (`--placement threshold`) would have kept both turns local."""
from __future__ import annotations

import threading

import pytest

from tests.helpers.stack import ProcessStack, managed, new_log_dir, scrape, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are the archivist of a small mountain library. The library holds maps of the valley, "
          "letters of the first settlers, weather diaries kept since 1870, and a collection of pressed "
          "alpine flowers. Visitors may read anything in the reading room but may not take originals "
          "out; copies cost ten cents a page. The library opens at nine and closes at five, except on "
          "Sundays. Answer questions about the collection in a few friendly sentences.")
FIRST = "What can I find about the weather in the valley?"
SECOND = "And may I take a diary home?"


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("placement"), registry_ttl_s=3.0, kv_cache_memory="96M",
                     router_args=["--slo-itl-ms", "1", "--log-level", "debug"])
    with managed(request, s):
        s.start(prefill=1, decode=1)
        s.wait_ready()
        yield s


def decisions(s) -> dict[tuple[str, str], float]:
    m = scrape(f"127.0.0.1:{s.router_metrics_port}")
    return {(lab["kind"], lab["reason"]): v for n, lab, v in m.samples if n == "duet_router_decisions_total"}


def delta(after, before) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def test_second_turn_local_while_decode_is_idle_remote_while_it_decodes(stack):
    s = stack
    client = s.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           extra_body={"ignore_eos": True})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": SECOND}]
    entry = s.workers()["decode-0"]
    assert entry.get("perf_step"), "the decode worker publishes its step-time model"
    # the first turn's pages reach the registry within a KV-event interval (50 ms): wait for them,
    # the race with a client that answers faster is not what this test is about
    held = (first.usage.prompt_tokens + first.usage.completion_tokens) // int(entry["page_size"]) - 1
    wait_until(lambda: s.redis().scard("duet:worker:decode-0:pages") >= held, 30, "decode-0's pages in the registry")

    before = decisions(s)
    idle = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    seen_idle = delta(decisions(s), before)
    assert seen_idle == {("local_prefill", "lowest_ttft"): 1}, seen_idle
    assert idle.usage.prompt_tokens_details.cached_tokens / idle.usage.prompt_tokens >= 0.8

    # streams decoding on decode-0 (new prompts: nothing held, so they go split)
    streams, stop = [], threading.Event()

    def stream(k: int) -> None:
        out = client.completions.create(model=MODEL, prompt=f"Story {k}: once upon a time", max_tokens=2000,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        streams.append(out)
        for _ in out:
            if stop.is_set():
                break
        out.close()  # the gateway cancels the request: decode frees it
    decoded = s.metrics("decode-0").value("duet_engine_tokens_computed_total", phase="decode")
    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        def decoding():
            m = s.metrics("decode-0")
            return (m.value("duet_running_requests") >= 4
                    and m.value("duet_engine_tokens_computed_total", phase="decode") - decoded >= 4 * 4)
        wait_until(decoding, 180, "4 streams decoding on decode-0")
        before = decisions(s)
        busy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        seen_busy = delta(decisions(s), before)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert list(seen_busy) in ([("split", "itl_target")], [("split", "lowest_ttft")]), seen_busy
    # the router's reason for that turn: local prefill was weighed and held back by the target
    routed = [line for line in s.procs["router"].log_text().splitlines() if "route " in line]
    assert "local_prefill" in routed[-1] and "(over the target)" in routed[-1], routed[-1]
    print("\n".join(routed))  # the decisions and their predicted figures, for -s
    assert busy.choices[0].message.content == idle.choices[0].message.content
    m = scrape(f"127.0.0.1:{s.router_metrics_port}")
    assert m.value("duet_router_predicted_ttft_seconds_count", kind="local_prefill") >= 1
    assert m.value("duet_router_predicted_ttft_seconds_count", kind="split") >= 1
    d = s.metrics("decode-0")
    assert d.value("duet_engine_step_seconds_count", phase="decode") > 0
    assert d.has("duet_engine_prefill_budget_tokens")
    s.wait_idle(["prefill-0", "decode-0"], timeout=120)
