"""A restarted Redis or router rebuilds what it knew from the workers (rule `restart-rebuilds`,
docs/ARCHITECTURE.md section 4), end to end under `duet up` (1 prefill + 1 decode, one thread
each, secure as by default; each worker with a small device pool over a host tier that keeps
every page leaving the device, so both tiers' page sets have members; the router places by
threshold, so a turn routed to the decode worker that holds most of its prompt is a
`local_prefill` decision: the observable that says the route was prefix-aware).

- Redis killed and restarted empty (no persistence): within a few seconds every worker's entry
  and both of its page sets are back as they were, and a conversation's next turn is routed
  prefix-aware again (the LoRA adapters loaded at run time come back too:
  tests/gateway/test_gateway_lora_record.py);
- the router killed (SIGKILL): the stream in flight finishes, a request sent while it is down
  waits for the new one and is served, and the new router routes the conversation's next turn
  prefix-aware;
- a small chaos run: Redis, then the router, killed while streams run and a chat goes on: every
  request ends well, and no page, request or routed load is left behind.

The seconds each rebuild took are printed (pytest -s), not asserted beyond a generous deadline."""
from __future__ import annotations

import time

import pytest
import redis

from tests.helpers.stack import DuetUp, child_process, managed, new_log_dir, wait_until
from tests.helpers.stream_ends import start_stream

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WORKERS = ("prefill-0", "decode-0")
DEADLINE_S = 60.0  # generous: a busy 2-core machine restarts a Python process in seconds
SYSTEM = ("You are the support assistant of {name}, a small company that imports green, black and oolong teas "
          "from family farms in Japan, India and Taiwan. Orders ship from Rotterdam on weekdays; shipping inside "
          "the European Union takes three to five days and is free above forty euros. Customers may return "
          "unopened tins within thirty days for a full refund; opened tins can be exchanged once. The loyalty "
          "programme gives one point per euro spent, and two hundred points buy a ten euro voucher. Brewing "
          "advice: green tea at seventy to eighty degrees for two minutes, black tea at ninety-five degrees for "
          "four minutes, oolong at ninety degrees for three minutes, and always with fresh, soft water. Answer "
          "briefly, politely and only about the company, its teas and its orders. If you do not know an answer, "
          "say so and offer to put the customer in touch with a person on the team, who answers emails within "
          "one working day.")
QUESTIONS = ["How long does shipping take to Germany?", "Is it free for fifty euros?", "Can I return an opened tin?",
             "What teas come from Taiwan?", "How do I brew oolong?"]


@pytest.fixture(scope="module")
def stack(request):
    # ~29 device pages of 16 tokens per worker: two conversations push each other's pages to the host tier
    up = DuetUp(new_log_dir("up-rebuild"), "--restart-backoff", "0.5", kv_cache_memory="22M",
                env={"DUET_PLACEMENT": "threshold", "DUET_KV_HOST_MEMORY": "256M",
                     "DUET_KV_HOST_WRITE_POLICY": "all",
                     # a loaded 2-core machine starts the new router in up to ~10 s (15 s by default)
                     "DUET_ROUTE_TIMEOUT": "60"})
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


class Chat:
    def __init__(self, client, name: str):
        self.client = client
        self.messages = [{"role": "system", "content": SYSTEM.format(name=name)}]

    def turn(self, question: str) -> None:
        self.messages.append({"role": "user", "content": question})
        r = self.client.chat.completions.create(model=MODEL, messages=self.messages, max_tokens=16, temperature=0)
        self.messages.append({"role": "assistant", "content": r.choices[0].message.content})


@pytest.fixture(scope="module")
def chats(stack):
    a, b = Chat(stack.client(), "Northwind Tea"), Chat(stack.client(), "Southwind Tea")
    for question in QUESTIONS[:2]:  # each chat's turns push the other's pages off the device
        a.turn(question)
        b.turn(question)
    return a, b


def page_sets(stack) -> dict[str, tuple[frozenset, frozenset]]:
    """Each worker's (pages, host pages) sets in the registry now."""
    r = stack.redis()
    return {w: (frozenset(r.smembers(f"duet:worker:{w}:pages")), frozenset(r.smembers(f"duet:worker:{w}:pages:host")))
            for w in WORKERS}


def settled_page_sets(stack):
    """The page sets once the workers are idle and the sets stop changing."""
    stack.wait_idle(list(WORKERS))
    last = {}

    def stable():
        nonlocal last
        now = page_sets(stack)
        same, last = now == last, now
        return now if same else None
    return wait_until(stable, 30, "the page sets to settle", interval=0.5)


def local_prefills(stack) -> float:
    """Routes to a decode worker that holds most of the prompt (the router's counter; 0 while it is down)."""
    try:
        return stack.router_metrics().value("duet_router_decisions_total", kind="local_prefill")
    except (OSError, RuntimeError):
        return 0.0


def reachable(read):
    """read() once Redis answers again; None while it does not."""
    try:
        return read()
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, OSError):
        return None


def test_redis_restarted_empty_gets_every_entry_and_page_set_back(stack, chats):
    a, _ = chats
    before = settled_page_sets(stack)
    assert all(held for held, _ in before.values()), before
    assert any(host for _, host in before.values()), "no page reached a host tier"
    entries = {w: f["instance_nonce"] for w, f in stack.workers().items()}
    child_process(stack, "redis-server").kill()
    killed_at = time.monotonic()
    stack._redis = None  # a new connection to the new server
    wait_until(lambda: reachable(lambda: stack.redis().ping()), DEADLINE_S, "Redis restarted", interval=0.1)
    back_at = time.monotonic()
    assert reachable(lambda: stack.redis().dbsize()) is not None
    wait_until(lambda: reachable(lambda: {w: f["instance_nonce"] for w, f in stack.workers().items()}) == entries,
               DEADLINE_S, "every worker's entry back, the same instances", interval=0.1)
    entries_at = time.monotonic()
    wait_until(lambda: reachable(lambda: page_sets(stack)) == before, DEADLINE_S,
               "both page sets of every worker back as they were", interval=0.1)
    pages_at = time.monotonic()
    # the next turn is routed to the decode worker that holds the conversation
    routed = local_prefills(stack)
    a.turn(QUESTIONS[2])
    assert local_prefills(stack) == routed + 1
    print(f"\nRedis killed: back in {back_at - killed_at:.2f}s; worker entries {entries_at - back_at:.2f}s and "
          f"page sets (device and host) {pages_at - back_at:.2f}s after it answered")
    assert stack.proc.alive


def test_router_killed_rebuilds_and_routes_prefix_aware(stack, chats):
    a, b = chats
    thread, result = start_stream(stack, max_tokens=48)
    router = child_process(stack, "services.cli router ")
    router.kill()
    killed_at = time.monotonic()
    b.turn(QUESTIONS[3])  # sent while the router is down: the gateway waits for the new one
    served_at = time.monotonic()
    thread.join(120)
    assert result["end"] == "done", result  # the stream never needed the router
    assert child_process(stack, "services.cli router ").pid != router.pid
    # the new router (its counters start at zero) routed that turn to the decode worker holding it
    assert local_prefills(stack) == 1
    a.turn(QUESTIONS[3])
    assert local_prefills(stack) == 2
    routed_at = time.monotonic()
    out = stack.proc.log_text()
    assert "router exited with code -9 (SIGKILL)" in out and "restarted router" in out
    print(f"\nrouter killed: a request sent at once served after {served_at - killed_at:.2f}s; the next turn "
          f"routed prefix-aware {routed_at - killed_at:.2f}s after the kill")
    wait_until(lambda: stack.router_metrics().value("duet_router_inflight_requests") == 0, 30,
               "the new router's load account back to zero")
    stack.wait_idle(list(WORKERS))


def test_redis_and_router_killed_in_turn_under_streams_lose_nothing(stack):
    """A small chaos run: Redis, then the router, SIGKILLed while four streams run and a chat goes
    on; every stream and turn ends well, and afterwards no worker holds a page or a request and
    the router's load account is back to zero."""
    streams = [start_stream(stack, max_tokens=40) for _ in range(4)]
    chat = Chat(stack.client(), "Eastwind Tea")
    chat.turn(QUESTIONS[0])
    child_process(stack, "redis-server").kill()
    chat.turn(QUESTIONS[1])  # on the last known set
    stack._redis = None
    wait_until(lambda: reachable(lambda: set(stack.workers())) == set(WORKERS), DEADLINE_S,
               "both workers registered in the restarted Redis", interval=0.1)
    child_process(stack, "services.cli router ").kill()
    chat.turn(QUESTIONS[2])  # waits for the new router
    for thread, result in streams:
        thread.join(120)
        assert result["end"] == "done", result
    stack.wait_idle(list(WORKERS))
    for w in WORKERS:
        for tier in ("device", "host"):
            assert stack.metrics(w).value("duet_kv_unaccounted_pages", tier=tier) == 0, (w, tier)
    wait_until(lambda: stack.router_metrics().value("duet_router_inflight_requests") == 0, 30,
               "the router's load account back to zero")
