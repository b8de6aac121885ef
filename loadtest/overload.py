"""`duet loadtest overload`: arrivals at a multiple of what the server can serve, for a while.

    duet loadtest overload --base-url http://localhost:8000 --factor 10 --duration 30 \
        [--rate R] [--gateway-pid PID]

Measures the capacity (completed req/s of a closed loop of --calibrate-concurrency clients
for --calibrate-s) unless --rate is given, then sends short completions evenly spaced at
factor x capacity for --duration s and waits for every answer. Prints the counts by status
(healthy: only 200 and 429), p50/p99 latency of the 200s, p99 of the 429s, the gateway's RSS
before/peak/after (--gateway-pid) and how fast a plain request is answered right after."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from loadtest.hostile.monitors import GatewayProcess, RssWatch


@dataclass
class OverloadResult:
    capacity_rps: float
    arrival_rps: float
    sent: int
    statuses: dict[str, int]
    admitted_p50_s: float
    admitted_p99_s: float
    refused_p99_s: float
    rss_before_mb: float | None
    rss_peak_mb: float | None
    rss_after_mb: float | None
    recovery_s: float  # a plain request right after the load: its latency
    recovery_status: int
    duration_s: float
    latencies: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def only_200_or_429(self) -> bool:
        return set(self.statuses) <= {"200", "429"}

    def report(self) -> str:
        rss = ("RSS (MB) before/peak/after: "
               f"{self.rss_before_mb:.0f}/{self.rss_peak_mb:.0f}/{self.rss_after_mb:.0f}"
               if self.rss_before_mb is not None else "RSS: not measured (no --gateway-pid)")
        return (f"overload: capacity {self.capacity_rps:.1f} req/s, arrivals {self.arrival_rps:.1f} req/s for "
                f"{self.duration_s:.0f}s: {self.sent} sent, statuses {dict(sorted(self.statuses.items()))}\n"
                f"  admitted (200) latency p50 {self.admitted_p50_s:.2f}s p99 {self.admitted_p99_s:.2f}s; "
                f"429 latency p99 {self.refused_p99_s:.3f}s\n"
                f"  {rss}\n"
                f"  right after: {self.recovery_status} in {self.recovery_s:.2f}s")


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": "Write one sentence about the sea:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def _one(http: httpx.AsyncClient, payload: dict, statuses: Counter, latencies: dict[str, list[float]]) -> None:
    started = time.monotonic()
    try:
        r = await http.post("/v1/completions", json=payload)
        key = str(r.status_code)
    except httpx.TimeoutException:
        key = "timeout"
    except httpx.HTTPError as exc:
        key = type(exc).__name__
    statuses[key] += 1
    latencies.setdefault(key, []).append(time.monotonic() - started)


async def calibrate(http: httpx.AsyncClient, model: str, max_tokens: int, concurrency: int, seconds: float) -> float:
    """Completed requests per second of a closed loop of `concurrency` clients."""
    done = 0
    deadline = time.monotonic() + seconds

    async def client():
        nonlocal done
        while time.monotonic() < deadline:
            r = await http.post("/v1/completions", json=body(model, max_tokens))
            if r.status_code == 200:
                done += 1
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_overload(base_url: str, *, factor: float = 10.0, duration_s: float = 30.0, rate: float | None = None,
                       max_tokens: int = 8, gateway_pid: int | None = None, timeout_s: float = 120.0,
                       calibrate_concurrency: int = 8, calibrate_s: float = 6.0) -> OverloadResult:
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        capacity = await calibrate(http, model, max_tokens, calibrate_concurrency, calibrate_s) if rate is None else 0
        arrival = rate if rate is not None else max(1.0, capacity * factor)
        statuses: Counter = Counter()
        latencies: dict[str, list[float]] = {}
        n = int(arrival * duration_s)
        with RssWatch(GatewayProcess(gateway_pid) if gateway_pid else None, interval_s=0.25) as rss:
            tasks, started = [], time.monotonic()
            for i in range(n):  # evenly spaced, on a schedule (a slow answer never delays a send)
                await asyncio.sleep(max(0.0, started + i / arrival - time.monotonic()))
                tasks.append(asyncio.create_task(_one(http, body(model, max_tokens), statuses, latencies)))
            await asyncio.gather(*tasks)
            t0 = time.monotonic()
            r = await http.post("/v1/completions", json=body(model, max_tokens))
            recovery = time.monotonic() - t0
    return OverloadResult(
        capacity_rps=capacity, arrival_rps=arrival, sent=n, statuses={k: v for k, v in statuses.items()},
        admitted_p50_s=_pct(latencies.get("200", []), 0.5), admitted_p99_s=_pct(latencies.get("200", []), 0.99),
        refused_p99_s=_pct(latencies.get("429", []), 0.99), rss_before_mb=rss.before,
        rss_peak_mb=rss.peak, rss_after_mb=rss.gateway.rss_mb() if rss.gateway else None, recovery_s=recovery,
        recovery_status=r.status_code, duration_s=duration_s, latencies=latencies)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet loadtest overload", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://localhost:8000")
    p.add_argument("--factor", type=float, default=10.0, help="arrival rate as a multiple of the measured capacity")
    p.add_argument("--rate", type=float, default=None, help="arrival rate (req/s); skips the calibration")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--gateway-pid", type=int, default=None, help="the gateway's process id, for RSS readings")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request, seconds")
    p.add_argument("--calibrate-concurrency", type=int, default=8)
    p.add_argument("--calibrate-s", type=float, default=6.0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args(argv)
    result = asyncio.run(run_overload(
        a.base_url.rstrip("/").removesuffix("/v1"), factor=a.factor, duration_s=a.duration, rate=a.rate,
        max_tokens=a.max_tokens, gateway_pid=a.gateway_pid, timeout_s=a.timeout,
        calibrate_concurrency=a.calibrate_concurrency, calibrate_s=a.calibrate_s))
    print(result.report())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: v for k, v in asdict(result).items() if k != "latencies"}, f, indent=1)
    return 0 if result.only_200_or_429 and result.recovery_status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
