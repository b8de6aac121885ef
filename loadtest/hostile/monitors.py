"""What is watched while a probe runs, each in its own thread (nothing the probe does delays a
reading): the gateway's RSS and CPU (psutil, a local pid); RSS every 50 ms, calling `on_cap`
past the cap (the runner then cuts the probe short); GET /health every 100 ms whether or not
earlier ones answered (a stalled loop shows in the p50; one still open counts its wait)."""
from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class GatewayProcess:
    pid: int

    def _read(self, what: Callable, default=None):
        try:
            import psutil  # only where the gateway is a local process
            return what(psutil.Process(self.pid))
        except Exception:  # gone, or not ours to read
            return default

    def rss_mb(self) -> float | None:
        return self._read(lambda p: p.memory_info().rss / 2**20)

    def cpu_s(self) -> float | None:
        return self._read(lambda p: sum(p.cpu_times()[:2]))  # user + system

    def cmdline(self) -> list[str]:
        return self._read(lambda p: p.cmdline(), [])

    def environ(self) -> dict[str, str]:
        return self._read(lambda p: p.environ(), {})


class RssWatch:
    """No gateway: nothing is read (before and peak stay None)."""

    def __init__(self, gateway: GatewayProcess | None, cap_growth_mb: float = float("inf"),
                 on_cap: Callable[[float], None] | None = None, interval_s: float = 0.05):
        self.gateway, self.cap_growth_mb, self.on_cap, self.interval_s = gateway, cap_growth_mb, on_cap, interval_s
        self.before = self.peak = gateway.rss_mb() if gateway else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-rss", daemon=True)

    def __enter__(self) -> "RssWatch":
        if self.gateway is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        capped = False
        while not self._stop.is_set():
            value = self.gateway.rss_mb()
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
                if not capped and self.before is not None and value - self.before > self.cap_growth_mb:
                    capped = True
                    if self.on_cap:
                        self.on_cap(value - self.before)
            self._stop.wait(self.interval_s)


@dataclass
class HealthStats:
    samples: int = 0
    p50_ms: float | None = None
    max_ms: float | None = None
    errors: int = 0  # non-200 answers and failures
    latencies_ms: list[float] = field(default_factory=list)


class HealthSampler:
    def __init__(self, base_url: str, interval_s: float = 0.1, max_open: int = 400, verify: bool = False):
        self.base_url, self.interval_s, self.max_open, self.verify = base_url, interval_s, max_open, verify
        self._latencies: list[float] = []
        self._errors = 0
        self._open: dict[int, float] = {}  # sample number -> sent at
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first_sent = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="hostile-health",
                                        daemon=True)
        self.stats = HealthStats()

    def __enter__(self) -> "HealthSampler":
        self._thread.start()
        self._first_sent.wait(10)  # a probe answered at once still gets a sample (a slow start when loaded)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        now = time.monotonic()
        with self._lock:
            values = [v * 1000 for v in self._latencies] + [(now - t) * 1000 for t in self._open.values()]
            self.stats = HealthStats(len(values), statistics.median(values) if values else None,
                                     max(values) if values else None, self._errors + len(self._open), values)

    async def _one(self, http: httpx.AsyncClient, k: int) -> None:
        sent = time.monotonic()
        with self._lock:
            self._open[k] = sent
        self._first_sent.set()
        try:
            r = await http.get("/health")
            ok = r.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        with self._lock:
            if self._open.pop(k, None) is None:
                return  # already counted as still open at the end
            self._latencies.append(time.monotonic() - sent)
            if not ok:
                self._errors += 1

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.max_open, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, limits=limits, verify=self.verify) as http:
            tasks = set()
            k, started = 0, time.monotonic()
            while not self._stop.is_set():
                if len(self._open) < self.max_open:
                    task = asyncio.create_task(self._one(http, k))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                k += 1
                await asyncio.sleep(max(0.0, started + k * self.interval_s - time.monotonic()))
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
