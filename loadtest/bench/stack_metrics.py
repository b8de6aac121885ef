"""What a bench section reads off a running `duet up` stack: each worker's metrics address, from
the ready lines in its log (one a start: a restarted worker appends another), the router's from
its listening line, and metric samples from any /metrics (a worker's, the router's, or the
gateway's on its HTTP port)."""
from __future__ import annotations

import re
import time
from pathlib import Path

READY = re.compile(r" ready: grpc .* metrics (\S+) ")
ROUTER = re.compile(r"router listening on (\S+):\d+ \(.*; metrics (\d+)\)")


def ready_addresses(log: Path) -> list[str]:
    """The metrics address of each start the log records, oldest first."""
    return READY.findall(log.read_text(errors="replace")) if log.is_file() else []


def router_metrics_address(log_dir: Path) -> str | None:
    """The metrics address of the router's latest start, or None (no router log, or metrics off)."""
    log = log_dir / "router.log"
    found = ROUTER.findall(log.read_text(errors="replace")) if log.is_file() else []
    return f"{found[-1][0]}:{found[-1][1]}" if found else None


def worker_metrics_address(log_dir: Path, worker: str, timeout_s: float = 60.0) -> str:
    """The metrics address of the worker's latest start (e.g. worker "prefill-0")."""
    deadline = time.monotonic() + timeout_s
    while not (found := ready_addresses(log_dir / f"{worker}.log")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no ready line in {log_dir / f'{worker}.log'}")
        time.sleep(0.5)
    return found[-1]


def scrape(address: str) -> list:
    """Every sample of the /metrics at address (one GET; httpx.HTTPError when it cannot be read)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def sample_sum(samples: list, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def metric_sum(address: str, name: str, **labels: str) -> float:
    return sample_sum(scrape(address), name, **labels)
