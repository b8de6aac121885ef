"""`duet up` heals, and drains, end to end: one stack for the module (1 prefill + 1 decode, one
thread each; secure, as by default: tests/e2e/test_e2e_security.py), its children killed one
after another, then stopped.

- kill -9 of the decode worker, with failover off (--migration-limit 0, DUET_MIGRATION_LIMIT here;
  with it on the stream goes on elsewhere: tests/e2e/test_e2e_failover.py): the stream it was
  serving ends with an error event, duet up says it restarted it, the stack serves again within 60 s (the router trusts the new instance
  once it proved its identity); the worker keeps its id and has a new instance nonce;
- kill -9 of Redis: the stream in flight ends with [DONE], new requests are served within
  60 s, Redis is back (empty, with its password), both workers registered again and prefill
  published the page hashes it holds again;
- a worker killed twice in a row (past --restart-limit 1) once the stack served: duet up leaves
  it down while the other worker runs (not the stack stopped), tries it again after
  --restart-retry, and the stack serves again;
- Ctrl-C: every child drains within the grace (DUET_DRAIN_GRACE=6 here): a short stream ends
  with [DONE], a long one with an error event, none is cut; duet up exits 0 and leaves no child
  (SIGTERM, which stops the children in order: tests/disagg/test_launcher_supervision.py, and
  tests/e2e/test_e2e_duet_up.py's stop).

And a `duet up` whose workers die at start every time gives up after --restart-limit tries
with exit code 1."""
from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
import redis

from services.launcher.shutdown import KILL_AFTER_S
from tests.helpers.stack import DuetUp, child_process, managed, new_log_dir, wait_until
from tests.helpers.stream_ends import start_stream

pytestmark = pytest.mark.slow

# for duet up and its children (tests/helpers/stack.py's 3 s leaves a worker too little head start on a
# busy 2-core machine: shutdown.py)
GRACE_S = 6.0
HEAL_S = 60.0
RETRY_S = 3.0
LONG_PROMPT = ("A careful geographer describes the spice markets of Zanzibar in exactly forty-one words, "
               "naming three spices, the months of the harvest and the ships that carry them north.")


@pytest.fixture(scope="module")
def stack(request):
    # one restart in a row, then a worker is left down and tried again after RETRY_S (the others serve)
    up = DuetUp(new_log_dir("up-heal"), "--restart-backoff", "0.5", "--restart-limit", "1",
                "--restart-retry", str(RETRY_S),
                env={"DUET_DRAIN_GRACE": str(GRACE_S), "DUET_MIGRATION_LIMIT": "0"})
    with managed(request, up.start()) as s:
        s.wait_ready()
        assert s.redis_password  # read by the helper where the children read it
        s.plain_redis_url = s.redis_url.replace(f":{s.redis_password}@", "")
        yield s


def session_processes(leader_pid: int) -> list[int]:
    """Live processes of the session duet up leads (tests/helpers/stack.py starts it in its own)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == leader_pid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return out


def model(stack) -> str:
    return stack.client().models.list().data[0].id


def served(stack) -> bool:
    try:
        out = stack.client(timeout=30).completions.create(model="SmolLM2-135M-Instruct", prompt="Hello",
                                                          max_tokens=4, temperature=0)
        return out.usage.completion_tokens > 0
    except Exception:
        return False


def test_killed_decode_worker_is_restarted_and_serves_again(stack):
    before = stack.workers()["decode-0"]
    thread, result = start_stream(stack, max_tokens=600)
    killed_at = time.monotonic()
    child_process(stack, "--worker-id decode-0").kill()
    thread.join(60)
    assert result["end"] == "error", result  # told at once, not cut
    wait_until(lambda: served(stack), HEAL_S, "the stack to serve again after the decode worker was killed",
               interval=1.0)
    assert time.monotonic() - killed_at < HEAL_S
    out = stack.proc.log_text()
    assert "decode-0 exited with code -9 (SIGKILL)" in out and "restarted decode-0" in out
    after = stack.workers()["decode-0"]  # the same worker id, a new instance
    assert after["instance_nonce"] != before["instance_nonce"] and after["role"] == "decode"
    assert stack.proc.alive


def test_killed_redis_is_restarted_and_streams_in_flight_finish(stack):
    # a prompt of several full pages: prefill caches them and publishes their hashes
    stack.client().completions.create(model=model(stack), prompt=LONG_PROMPT, max_tokens=2)
    pages_key = "duet:worker:prefill-0:pages"
    held = wait_until(lambda: stack.redis().smembers(pages_key), 10, "prefill's page hashes in the registry")
    thread, result = start_stream(stack, max_tokens=48)
    killed_at = time.monotonic()
    child_process(stack, "redis-server").kill()
    thread.join(120)
    assert result["end"] == "done", result  # the stream never needed Redis
    wait_until(lambda: served(stack), HEAL_S, "the stack to serve after Redis was killed", interval=1.0)
    assert time.monotonic() - killed_at < HEAL_S
    out = stack.proc.log_text()
    assert "redis exited with code -9 (SIGKILL)" in out and "restarted redis" in out
    stack._redis = None  # a new connection to the new server
    wait_until(lambda: set(stack.workers()) == {"prefill-0", "decode-0"}, 30,
               "both workers registered in the restarted Redis")
    wait_until(lambda: stack.redis().smembers(pages_key) >= held, 30, "prefill's page hashes published again")
    with pytest.raises(redis.AuthenticationError):  # restarted with its password
        redis.Redis.from_url(stack.plain_redis_url, socket_timeout=5).ping()
    assert stack.proc.alive


def test_a_worker_that_keeps_dying_once_the_stack_served_is_left_down_and_tried_again(stack):
    child_process(stack, "--worker-id prefill-0 ").kill()
    wait_until(lambda: "restarted prefill-0" in stack.proc.log_text(), HEAL_S, "prefill-0's restart")
    child_process(stack, "--worker-id prefill-0 ").kill()  # its second death in a row: past --restart-limit 1
    wait_until(lambda: "leaving it down" in stack.proc.log_text(), 30, "duet up to leave prefill-0 down")
    out = stack.proc.log_text()
    assert re.search(r"prefill-0 exited with code -9 \(SIGKILL\) after [\d.]+s; leaving it down: it died 2 "
                     r"times in a row", out), out[-2000:]
    assert stack.proc.alive and "stopping the stack" not in out
    # tried again after --restart-retry; the stack serves again
    wait_until(lambda: stack.proc.log_text().count("restarted prefill-0") == 2, RETRY_S + 30, "the retry")
    wait_until(lambda: served(stack), HEAL_S, "the stack to serve with prefill-0 back", interval=1.0)


def test_ctrl_c_drains_every_child_within_the_grace(stack):
    """Ctrl-C in a terminal: SIGINT to duet up's whole process group, so every child gets it too
    (Redis and the router stop at once) and duet up then stops them in order."""
    assert len(session_processes(stack.proc.pid)) >= 6  # duet up, redis, router, two workers, gateway
    long_thread, long_result = start_stream(stack, max_tokens=600)
    short_thread, short_result = start_stream(stack, max_tokens=6)
    asked_at = time.monotonic()
    os.killpg(stack.proc.pid, signal.SIGINT)  # tests/helpers/stack.py started duet up as a group leader
    stack.proc.popen.wait(GRACE_S + KILL_AFTER_S + 30)
    took = time.monotonic() - asked_at
    long_thread.join(10)
    short_thread.join(10)
    assert stack.proc.popen.returncode == 0
    assert short_result["end"] == "done", short_result
    assert long_result["end"] == "error", long_result  # the worker ended it, the gateway said so
    out = stack.proc.log_text()
    assert "killing it" not in out, out[-3000:]  # every child drained and exited by itself
    assert took < GRACE_S + KILL_AFTER_S, took
    wait_until(lambda: session_processes(stack.proc.pid) == [], 10, "every child of duet up to exit")


def test_a_worker_that_dies_at_start_every_time_ends_duet_up(request):
    up = DuetUp(new_log_dir("up-crashloop"), "--restart-limit", "2", "--restart-backoff", "0.2",
                worker_args=["--no-such-flag"])
    with managed(request, up.start()):
        up.proc.popen.wait(180)
        out = up.proc.log_text()
        assert up.proc.popen.returncode == 1, out[-3000:]
        assert "unrecognized arguments: --no-such-flag" in out
        assert re.search(r"(prefill|decode)-0 exited with code 2 .*restart 2 of at most 2 in a row", out)
        assert re.search(r"(prefill|decode)-0 exited with code 2 after [\d.]+s; giving up on it: it died 3 times "
                         r"in a row", out)
        assert "stopping the stack (exit code 1)" in out
        wait_until(lambda: session_processes(up.proc.pid) == [], 10, "every child of duet up to exit")
