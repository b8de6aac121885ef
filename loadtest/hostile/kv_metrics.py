"""The decode workers' KV usage (`duet_kv_cache_usage_ratio` on their /metrics). Addresses come
from --worker-metrics, or the Redis registry: each worker's hash `duet:worker:<id>` names its
`role` and `metrics` (host:port); decode and `both` workers hold a dropped request's KV."""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import httpx

KV_METRIC = "duet_kv_cache_usage_ratio"
_SAMPLE = re.compile(rf"^{KV_METRIC}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
KV_ROLES = ("decode", "both")


def decode_metrics_from_registry(redis_url: str, prefix: str = "duet") -> list[str]:
    """host:port of every decode / both worker's /metrics, read from the registry."""
    import redis

    r = redis.Redis.from_url(redis_url, socket_timeout=2, decode_responses=True)
    try:
        out = []
        for key in r.scan_iter(f"{prefix}:worker:*"):
            if ":" in key[len(f"{prefix}:worker:"):]:  # side keys (:nixl, :pages)
                continue
            fields = r.hgetall(key)
            if fields.get("role") in KV_ROLES and fields.get("metrics"):
                out.append(fields["metrics"])
        return sorted(out)
    finally:
        r.close()


def parse_kv_usage(text: str) -> float | None:
    """The largest duet_kv_cache_usage_ratio sample in a Prometheus exposition (None: absent)."""
    values = [float(v) for v in _SAMPLE.findall(text)]
    return max(values) if values else None


@dataclass
class KvWatch:
    addresses: list[str]  # host:port (or a URL) of each worker's /metrics
    errors: list[str] = field(default_factory=list)

    def _url(self, address: str) -> str:
        base = address if "://" in address else f"http://{address}"
        return base if base.rstrip("/").endswith("/metrics") else base.rstrip("/") + "/metrics"

    async def usage(self, http: httpx.AsyncClient) -> float | None:
        """The highest KV usage over the workers now (None: none could be read)."""
        values = []
        for address in self.addresses:
            try:
                r = await http.get(self._url(address), timeout=2)
                value = parse_kv_usage(r.text)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                self.errors.append(f"{address}: {type(exc).__name__}")
                continue
            if value is not None:
                values.append(value)
        return max(values) if values else None

    async def trace(self, *, watch_s: float, interval_s: float = 0.25, idle_for_s: float = 1.0,
                    rise_within_s: float = 5.0) -> tuple[list[tuple[float, float]], float | None]:
        """Sample until usage has been 0 for `idle_for_s` after being above it (or never rose
        within `rise_within_s`), or `watch_s` passed. Returns ((t, usage) samples, the time it
        reached 0 for good: None if it never did)."""
        samples: list[tuple[float, float]] = []
        if not self.addresses:
            return samples, None
        started = time.monotonic()
        rose, zero_since = False, None
        async with httpx.AsyncClient() as http:
            while True:
                t = time.monotonic() - started
                value = await self.usage(http)
                if value is not None:
                    samples.append((round(t, 3), value))
                    if value > 0:
                        rose, zero_since = True, None
                    elif zero_since is None:
                        zero_since = t
                if zero_since is not None and ((rose and t - zero_since >= idle_for_s)
                                               or (not rose and t >= rise_within_s)):
                    return samples, (zero_since if rose else 0.0)
                if t >= watch_s or (not samples and t >= 3.0):  # unreadable: give up early
                    return samples, None
                await asyncio.sleep(interval_s)
