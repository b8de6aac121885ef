"""A worker that hangs is lost like one that died: the gateway's HTTP/2 keepalive to the workers.

A worker SIGSTOPped mid stream stops answering but its sockets stay open (what a node that drops
off the network, or a frozen container, looks like to its peers): no connection
reset ever comes, and the gateway's streams on it would wait forever. The gateway pings every
worker connection with calls in flight (`--worker-keepalive`, `--worker-keepalive-timeout`); an
unanswered ping ends the connection's calls UNAVAILABLE, and their streams move to another
worker as from a dead one (services/gateway/backends/migration.py). Every stream ends with the
unfaulted run's greedy text, within the keepalive's bounds; once the worker runs again it finds
its callers gone and frees what it held.

Real processes: redis-server, the router, two `both` workers (the default model on the CPU) and
the gateway, each its own process; the official `openai` client."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.helpers.stack import ProcessStack, managed, new_log_dir, wait_until

pytestmark = pytest.mark.slow

STREAMS = 8
MAX_TOKENS = 48
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 2.0, 2.0
WORKERS = ("both-0", "both-1")
QUESTIONS = [f"Tell me one fact about the number {i * 7 + 3}." for i in range(STREAMS)]


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("hung-worker"), registry_ttl_s=4.0, kv_cache_memory="128M",
                     gateway_args=["--worker-keepalive", str(KEEPALIVE_S),
                                   "--worker-keepalive-timeout", str(KEEPALIVE_TIMEOUT_S)])
    with managed(request, s.start(prefill=0, decode=0, both=2)) as s:
        s.wait_ready()
        yield s


class Stream:
    def __init__(self):
        self.text, self.chunks, self.reason, self.error = "", 0, None, None

    def run(self, client, model: str, question: str) -> None:
        try:
            for chunk in client.chat.completions.create(
                    model=model, stream=True, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": question}]):
                for choice in chunk.choices:
                    self.chunks += 1
                    self.text += choice.delta.content or ""
                    self.reason = choice.finish_reason or self.reason
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def run_all(stack, while_running=None) -> tuple[list[Stream], float]:
    client = stack.client(timeout=120)
    model = client.models.list().data[0].id
    streams = [Stream() for _ in QUESTIONS]
    threads = [threading.Thread(target=s.run, args=(client, model, q), daemon=True) for s, q in zip(streams, QUESTIONS)]
    for t in threads:
        t.start()
    stopped_at = while_running(streams) if while_running else time.monotonic()
    for t in threads:
        t.join(150)
        assert not t.is_alive(), "a stream hung"
    return streams, time.monotonic() - stopped_at


def test_a_worker_that_stops_answering_mid_stream_is_lost_within_the_keepalive(stack):
    reference, _ = run_all(stack)
    assert all(s.error is None and s.reason == "length" for s in reference), [s.error for s in reference]
    stack.wait_idle(timeout=30)
    victim: list[str] = []

    def stop_one(streams):
        wait_until(lambda: all(s.chunks >= 3 for s in streams), 60, "every stream's first tokens")
        busy = {w: stack.running(w) for w in WORKERS}
        victim.append(max(busy, key=busy.get))
        assert busy[victim[0]] >= 1, busy
        stack.procs[victim[0]].signal(signal.SIGSTOP)
        return time.monotonic()

    try:
        streams, took = run_all(stack, stop_one)
    finally:
        if victim:
            stack.procs[victim[0]].signal(signal.SIGCONT)
    assert [s.error for s in streams] == [None] * STREAMS
    assert [s.text for s in streams] == [s.text for s in reference]  # moved, with the same greedy answer
    assert all(s.reason == "length" for s in streams)
    # found lost by the keepalive (4 s here; no connection reset ever comes: without the pings every
    # stream on the stopped worker waits until the client's own timeout), then finished elsewhere
    # (about 5 s in all on this CPU)
    assert took < 30, took
    moved = stack.gateway_metrics().value("duet_migrations_total", cause="decode_stream")
    assert moved >= 1
    # the worker runs again: its callers are gone, it frees what it held, and serves again
    stack.wait_registered(list(WORKERS), timeout=60)
    stack.wait_idle(timeout=60)
