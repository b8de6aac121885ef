"""`duet up --gateway-processes 2`: two gateway processes share the API port (SO_REUSEPORT),
through real processes (Redis, router, a `both` worker, the planner) and the official `openai`
client.

Connections spread over both processes (each one's own /metrics counts some of the requests and
together they count all), each admits half of the worker's capacity, the planner reads both processes' metrics, and with one process
SIGKILLed the other takes every request until `duet up` has started it again on the same port."""
from __future__ import annotations

import os
import re
import signal

import openai
import psutil
import pytest

from tests.helpers.stack import DuetUp, managed, new_log_dir, scrape, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(request):
    s = DuetUp(new_log_dir("gateway-processes"), "--both", "1", "--prefill", "0", "--decode", "0",
               "--gateway-processes", "2", planner=True)
    with managed(request, s.start()):
        yield s.wait_ready()


def metrics_addresses(s) -> list[str]:
    """host:port of each gateway process's /metrics, from duet up's banner."""
    line = re.search(r"2 gateway processes, metrics on each: (.+?)\)$", s.proc.log_text(), re.M).group(1)
    return [url.removeprefix("http://") for url in line.split(", ")]


def served(address: str) -> float:
    return scrape(address).value("duet_requests_total", service="gateway", endpoint="completions")


def ask(s, n: int) -> list[str]:
    """n completions, each on a new client (a new connection: the kernel picks the process)."""
    out = []
    for i in range(n):
        with openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0) as client:
            out.append(client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=2,
                                                 temperature=0).choices[0].text)
    return out


def test_two_gateway_processes_share_the_port_and_one_killed_is_covered_then_back(stack):
    s = stack
    addresses = metrics_addresses(s)
    assert len(addresses) == 2
    before = [served(a) for a in addresses]
    assert len(ask(s, 16)) == 16
    after = [served(a) for a in addresses]
    spread = [b - a for a, b in zip(before, after)]
    assert sum(spread) == 16 and min(spread) >= 1, spread  # both took connections
    # each process admits half of the worker's capacity: together they admit it once
    worker = next(iter(s.workers().values()))
    capacity = (int(worker["max_running_requests"]), 2 * int(worker["max_batched_tokens"]))
    assert min(capacity) > 0, worker
    budgets = [(scrape(a).value("duet_gateway_sequence_budget"), scrape(a).value("duet_gateway_prefill_budget"))
               for a in addresses]
    assert budgets == [(-(-capacity[0] // 2), -(-capacity[1] // 2))] * 2, (budgets, capacity)
    planner = (s.log_dir / "planner.log").read_text()
    assert all(f"http://{a}/metrics" in planner for a in addresses), planner[:2000]

    # one process killed: the other serves every request while duet up starts it again
    port = addresses[1].split(":")[1]
    victim = next(c for c in psutil.Process(s.proc.pid).children(recursive=True)
                  if "gateway" in c.cmdline() and port in c.cmdline())
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)  # gone, its socket closed: what its accept queue held was reset with it
    assert len(ask(s, 6)) == 6
    wait_until(lambda: served(addresses[1]) == 0 or None, 120, "the killed gateway process back (counting from 0)")
    before = [served(a) for a in addresses]
    assert len(ask(s, 16)) == 16
    assert min(served(a) - b for a, b in zip(addresses, before)) >= 1  # both again
