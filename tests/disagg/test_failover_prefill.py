"""A prefill worker dies mid-transfer and the client never sees it: 2 prefill
+ 1 decode workers as separate processes (real redis-server, router, gateway with failover on,
NIXL/UCX), a long prompt frozen mid-prefill on one prefill worker, which is then SIGKILLed.

The gateway prefills the request again on the other prefill worker into a fresh reservation
(the first one is cancelled: decode keeps its pages while the dead writer is registered, frees
them once it is gone, the rule `no-reuse-while-writing`), and the answer equals the unfaulted
one. Afterwards neither side holds a page or a request. With failover off the same kill is a
clean error: tests/disagg/test_failures_workers.py::test_prefill_killed_after_reservation."""
from __future__ import annotations

import time

import pytest

from tests.helpers.failure_probes import CHUNK, frozen_mid_prefill, holder, long_request
from tests.helpers.stack import ProcessStack, managed, new_log_dir, wait_until

pytestmark = pytest.mark.slow

TTL_S = 4.0
# ~500 tokens: some 30 steps of 16 tokens, long enough to freeze prefill mid-way, short enough to
# prefill again on a busy 2-core machine
PROMPT = " ".join(f"item {i} is a small grey pebble;" for i in range(60))


@pytest.fixture(scope="module")
def stack(request):
    # a move may take as long as prefilling the prompt again at 16 tokens a step
    s = ProcessStack(new_log_dir("failover-prefill"), registry_ttl_s=TTL_S, kv_cache_memory="160M",
                     gateway_args=["--migration-deadline", "110"],
                     worker_args=["--max-num-batched-tokens", str(CHUNK)])
    with managed(request, s.start(prefill=2, decode=1)) as s:
        s.wait_ready()
        yield s


def test_a_prefill_worker_killed_mid_transfer_is_replaced_and_nothing_leaks(stack):
    model = stack.client().models.list().data[0].id
    before = stack.gateway_metrics()
    request = long_request(stack, model, PROMPT)
    holder(stack, stack.worker_ids("decode"), "the decode reservation")
    victim = holder(stack, stack.worker_ids("prefill"), "the prefill worker computing the long prompt")
    with frozen_mid_prefill(stack, victim, request):
        stack.kill(victim)
    request.join(timeout=300)
    assert request.error is None, request.error
    after = stack.gateway_metrics()
    assert after.value("duet_migrations_total", cause="prefill") - before.value(
        "duet_migrations_total", cause="prefill") == 1
    rebuilt = after.value("duet_migration_rebuilt_tokens_total", source="recomputed")
    assert rebuilt > 400  # the other prefill worker held none of it: computed again, once

    # nothing leaked: the dead writer leaves the registry, then decode frees the first reservation
    wait_until(lambda: victim not in stack.workers(), TTL_S + 10, f"{victim} to leave the registry")
    survivors = [w for w in stack.known_workers() if w != victim and w in stack.workers()]
    stack.wait_idle(survivors, timeout=30)

    time.sleep(1.5)  # one watcher scan: the router forgets the dead prefill worker
    again = long_request(stack, model, PROMPT).join(timeout=300)  # unfaulted (its prompt now cached)
    assert again.error is None and again.result == request.result
    stack.wait_idle(survivors, timeout=30)
