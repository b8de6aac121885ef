"""What is watched while a probe runs, each in its own thread so that nothing the probe
does (a large body to encode, a slow answer) delays a reading:

* GatewayProcess: the gateway's resident memory and CPU time (psutil, a local pid);
* RssWatch: RSS sampled every 50 ms; past the cap it calls `on_cap` (the runner then
  cuts the probe short, so a memory bomb cannot take the machine down);
* HealthSampler: GET /health on a fixed schedule (every 100 ms) whether or not earlier
  ones answered, so a stalled event loop shows in the p50 and not only in one slow sample;
  a request still open when the probe ends counts with the time it has waited so far."""
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

    def _proc(self):
        import psutil  # only where the gateway is a local process
        return psutil.Process(self.pid)

    def rss_mb(self) -> float | None:
        try:
            return self._proc().memory_info().rss / 2**20
        except Exception:  # gone, or not ours to read
            return None

    def cpu_s(self) -> float | None:
        try:
            t = self._proc().cpu_times()
            return t.user + t.system
        except Exception:
            return None

    def cmdline(self) -> list[str]:
        try:
            return self._proc().cmdline()
        except Exception:
            return []

    def environ(self) -> dict[str, str]:
        try:
            return self._proc().environ()
        except Exception:
            return {}


class RssWatch:
    def __init__(self, gateway: GatewayProcess, cap_growth_mb: float, on_cap: Callable[[float], None],
                 interval_s: float = 0.05):
        self.gateway = gateway
        self.cap_growth_mb = cap_growth_mb
        self.on_cap = on_cap
        self.interval_s = interval_s
        self.before = gateway.rss_mb()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-rss", daemon=True)
        self._capped = False

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.gateway.rss_mb()
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
                if (not self._capped and self.before is not None
                        and value - self.before > self.cap_growth_mb):
                    self._capped = True
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
        self.base_url = base_url
        self.interval_s = interval_s
        self.max_open = max_open
        self.verify = verify
        self._latencies: list[float] = []
        self._errors = 0
        self._open: dict[int, float] = {}  # sample number -> sent at
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="hostile-health",
                                        daemon=True)
        self.stats = HealthStats()

    def __enter__(self) -> "HealthSampler":
        self._thread.start()
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
