"""Overload through `duet up` split (1 prefill + 1 decode, default model): arrivals at 10x
what the stack serves, for 20 s (loadtest/overload.py measures the capacity first). The
gateway admits 8 generations and queues 16 more; every answer is 200 or 429 with
Retry-After (never a 5xx, a dropped connection or a hang), the gateway's memory (RSS)
stays bounded, a plain request right after is served promptly, and every worker is idle
again.

Rerun alone (prints the figures):
    PYTHONPATH=$PWD python -m pytest -q -s tests/e2e/test_e2e_overload.py
Against any running gateway:
    python -m loadtest overload --base-url http://127.0.0.1:8000 --factor 10 --duration 30 --gateway-pid PID"""
from __future__ import annotations

import asyncio
import os

import pytest

from loadtest.overload import run_overload
from tests.helpers.hostile_load import snapshot, wait_idle_again
from tests.helpers.stack import DuetUp, managed, new_log_dir

pytestmark = pytest.mark.slow

DURATION_S = float(os.environ.get("DUET_OVERLOAD_S", "20"))
RSS_GROWTH_MB = 150  # bounded: the gateway holds at most 8 + 16 requests, whatever arrives


@pytest.fixture(scope="module")
def stack(request):
    env = {"DUET_MAX_CONCURRENT_REQUESTS": "8", "DUET_MAX_QUEUED_REQUESTS": "16", "DUET_QUEUE_TIMEOUT": "15",
           "DUET_RETRY_AFTER": "2"}
    s = DuetUp(new_log_dir("overload"), "--prefill", "1", "--decode", "1", kv_cache_memory="256M", env=env)
    with managed(request, s.start()) as s:
        s.wait_ready()
        yield s


def test_ten_times_capacity_gets_200_or_429_and_bounded_memory(stack):
    base = stack.base_url.removesuffix("/v1")
    before = snapshot(stack)
    result = asyncio.run(run_overload(base, factor=10, duration_s=DURATION_S, max_tokens=8,
                                      gateway_pid=stack.gateway_pid(), timeout_s=90, calibrate_s=5))
    print("\n" + result.report())
    assert result.only_200_or_429, result.statuses  # no 5xx, no timeout, no dropped connection
    assert result.statuses.get("200", 0) > 0 and result.statuses.get("429", 0) > 0, result.statuses
    assert result.statuses["429"] > result.statuses["200"], result.statuses  # 10x: most are refused
    assert result.refused_p99_s < 20, result.refused_p99_s  # refused within the queue timeout, never hung
    assert result.rss_peak_mb - result.rss_before_mb < RSS_GROWTH_MB, result.report()
    assert result.recovery_status == 200 and result.recovery_s < 10, result.report()
    after, settled_s = wait_idle_again(stack, before, 30)
    assert after.idle and after.registry == before.registry, after
    metrics = stack.gateway_metrics()
    assert metrics.value("duet_requests_total", status="500") == 0
    assert metrics.value("duet_gateway_refused_requests") >= result.statuses["429"]
