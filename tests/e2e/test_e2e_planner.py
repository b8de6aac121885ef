"""The planner on `duet up` (its default: two switchable workers, secure), through real processes:
redis, the router, the workers (gRPC, KV over NIXL), the gateway, `duet planner`, and the
official openai client.

The load shifts from long single-turn prompts (nothing cached: a prefill worker earns its keep)
to multi-turn chat (each turn's prompt mostly cached where the conversation lives, short answers
streaming side by side: a worker that only prefills sits idle while one worker carries every
stream). The planner keeps the split through the first and switches the workers to `both`
during the second: seen in its log, in its decision metric, in the workers' switch metric and
in the registry; a split stands its dwell time before any later switch. No request fails, and requests sent before the switch get the same greedy
answers after it. Only the planner may switch a worker: the gateway's certificate is refused."""
from __future__ import annotations

import re

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.client_loops import ClientLoops
from tests.helpers.stack import DuetUp, managed, new_log_dir, scrape, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# the planner decides every second over the last 10 s, once 3 requests are in and a split has
# stood 8 s, and switches for a split predicted 25% better (the defaults suit a production load:
# seconds would make it flap there; the long prompts below put 2b within ~10% of 1p1d on a loaded
# CPU, the chat far past 25%). The CPU's loose targets (TTFT 5 s, ITL 250 ms) leave the split room
# to spare on an idle machine (score 0.6): without the `meets_targets` hold (its own unit test,
# tests/disagg/test_planner_decide.py) the switch depends on the margin alone, not on the load
PLANNER_ENV = {"DUET_PLANNER_INTERVAL": "1", "DUET_PLANNER_WINDOW": "10", "DUET_PLANNER_DWELL": "8",
               "DUET_PLANNER_MIN_REQUESTS": "3", "DUET_PLANNER_HYSTERESIS": "0.25",
               "DUET_PLANNER_HEADROOM_ABOVE": "0",
               # a switching worker hands over any stream past its share (the default waits for 8
               # more): the chat streams under way at the switch may move, and answer the same
               "DUET_PLANNER_HAND_OVER_MIN": "1"}
LONG_OUT = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
WORDS = ("river", "stone", "lantern", "harbor", "meadow", "copper", "violin", "glacier", "orchard", "compass")


def long_prompt(k: int) -> str:
    """~250 tokens, none shared with another prompt's start (nothing cached)."""
    body = " ".join(f"{WORDS[(k + i) % len(WORDS)]}{i % 7}" for i in range(120))
    return f"Report {k}: {body}. Summary of report {k}:"


@pytest.fixture(scope="module")
def up(request):
    stack = DuetUp(new_log_dir("planner"), kv_cache_memory="96M", env=PLANNER_ENV, planner=True)
    with managed(request, stack.start()) as s:
        s.wait_ready()
        yield s


def planner_metrics(s):
    argv = s._child_argv("planner")
    return scrape(f"127.0.0.1:{argv[argv.index('--metrics-port') + 1]}")


def switches(s) -> float:
    return planner_metrics(s).value("duet_planner_decisions_total", action="switch")


def roles(s) -> dict[str, str]:
    return {w: f["role"] for w, f in s.workers().items()}


def test_a_shift_to_multi_turn_chat_switches_the_workers_with_no_failure_and_the_same_answers(up):
    s = up
    client = s.client()
    assert roles(s) == {"worker-0": "prefill", "worker-1": "decode"}
    assert all(f["switchable"] == "1" for f in s.workers().values())

    def single_turn(k: int, i: int):
        prompt = long_prompt(100 * k + i)
        out = client.completions.create(model=MODEL, prompt=prompt, **LONG_OUT)
        return ("completion", prompt), out.choices[0].text

    long_clients = ClientLoops(single_turn, 2)
    try:  # long prompts, answers streaming beside them: the split stays
        wait_until(lambda: len(long_clients.done) >= 8 or long_clients.errors, 150, "eight long prompts answered")
    finally:
        long_clients.finish()
    assert not long_clients.errors, long_clients.errors
    assert switches(s) == 0 and roles(s) == {"worker-0": "prefill", "worker-1": "decode"}
    # it weighed both splits (which it wants here is close on this CPU: 2b spreads the decode rows,
    # 1p1d keeps prefill out of them; the hysteresis keeps the split standing)
    weighed = planner_metrics(s)
    assert all(weighed.value("duet_planner_predicted_score", split=x) > 0 for x in ("1p1d", "2b"))

    conversations: dict[int, list[dict]] = {}

    def chat_turn(k: int, i: int):
        history = conversations.setdefault(k, [{"role": "system", "content": f"You are assistant {k}. "
                                                + long_prompt(k)}])
        if len(history) > 9:  # a new conversation every few turns
            del history[1:]
        messages = history + [{"role": "user", "content": f"Question {i}: name a {WORDS[(k + i) % len(WORDS)]}."}]
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        answer = out.choices[0].message.content
        history[:] = messages + [{"role": "assistant", "content": answer}]
        return ("chat", tuple((m["role"], m["content"]) for m in messages)), answer

    chat_clients = ClientLoops(chat_turn, 4)
    try:  # multi-turn chat: the planner moves both workers to `both`
        wait_until(lambda: switches(s) >= 1 or chat_clients.errors, 150, "the planner's switch")
        split_turns = list(chat_clients.done)  # answered while the workers were split (or switching)
        wait_until(lambda: roles(s) == {"worker-0": "both", "worker-1": "both"} or chat_clients.errors, 30,
                   "both workers `both` in the registry")
        before = len(chat_clients.done)
        wait_until(lambda: len(chat_clients.done) >= before + 4 or chat_clients.errors, 120, "chat after the switch")
    finally:
        chat_clients.finish()
    assert not chat_clients.errors, chat_clients.errors

    planner_log = (s.log_dir / "planner.log").read_text()
    switched = re.findall(r"^\S+ (\d\d):(\d\d):(\d\d),(\d+) .*planner switch \((\w+)\): (\w+) -> (\w+);",
                          planner_log, re.M)
    assert switched and switched[0][4:] in (("headroom", "1p1d", "2b"), ("slo", "1p1d", "2b")), planner_log[-3000:]
    for worker_id, was in (("worker-0", "prefill"), ("worker-1", "decode")):
        assert s.metrics(worker_id).value("duet_worker_role_switches_total", from_role=was, to_role="both") >= 1
        assert f"role switch: {was} -> both (planner: 1p1d -> 2b" in (s.log_dir / f"{worker_id}.log").read_text()
    # no flapping: a split stands its dwell time before the next switch. (Whether it switches back
    # once within the chat's tail depends on a few requests a window on this loaded CPU: the turns
    # that open a conversation are all uncached, and a window may hold little else.)
    at = [3600 * int(h) + 60 * int(m) + int(sec) + int(ms) / 1000 for h, m, sec, ms, *_ in switched]
    assert all(b - a >= float(PLANNER_ENV["DUET_PLANNER_DWELL"]) - 0.5 for a, b in zip(at, at[1:])), switched
    assert switches(s) == len(switched)
    assert re.search(r"planner: worker-1 decode -> both \(\d+ request\(s\) under way\)", planner_log), \
        planner_log[-3000:]
    # then, with both workers `both`, the decode worker's streams past its share (if any were
    # still running) handed over: "planner: worker-1 handed N of M decoding stream(s) over"
    # every stream a worker handed over went on elsewhere (none is a failed request: errors above)
    handed = sum(s.metrics(w).value("duet_worker_streams_handed_over_total") for w in ("worker-0", "worker-1"))
    assert s.gateway_metrics().value("duet_migrations_total", cause="handed_over") == handed

    # what was answered before the switch is answered the same after it (greedy)
    asked = long_clients.done[::4] + split_turns[::max(1, len(split_turns) // 3)][:3]
    for (kind, request), answer in asked:
        if kind == "completion":
            again = client.completions.create(model=MODEL, prompt=request, **LONG_OUT)
            assert again.choices[0].text == answer
        else:
            messages = [{"role": role, "content": content} for role, content in request]
            again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            assert again.choices[0].message.content == answer


def test_only_the_planner_may_switch_a_worker(up):
    with up.worker_channel("worker-0", "decode", as_child="gateway") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            duet_pb2_grpc.WorkerAdminStub(channel).SetRole(duet_pb2.SetRoleRequest(role="prefill"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only planner may call it" in refused.value.details()
