"""What one probe recorded, and the checks verdicts are made of."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP, UNCLEAR = "PASS", "FAIL", "SKIP", "UNCLEAR"


def is_openai_error(body: bytes | str | None) -> bool:
    """True for OpenAI's error shape: {"error": {"message": str, "type": str, "param", "code"}}."""
    if body is None:
        return False
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error)


@dataclass
class ProbeResult:
    name: str
    item: str    # its checklist item number (loadtest/hostile/README.md; "extra": a related probe)
    expect: str  # the verdict the checklist expects, in words
    status: int | str | None = None  # HTTP status, or "timeout" / an exception's name
    error_json: bool | None = None   # the body is OpenAI error JSON (None: a 2xx, or no body)
    latency_s: float | None = None
    body_head: str = ""              # the first bytes of the answer, for the reader
    # the gateway process (psutil), when its pid is known
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    gateway_cpu_s: float | None = None
    # GET /health sent every ~100 ms during the probe (open loop: a stalled loop shows in the p50)
    health_samples: int = 0
    health_p50_ms: float | None = None
    health_max_ms: float | None = None
    health_errors: int = 0
    # admission probes: a 1-token request of another client, sent during the attack
    victim_ms: float | None = None
    victim_status: int | str | None = None
    # disconnect probe: decode workers' duet_kv_cache_usage_ratio after the disconnect
    kv_trace: list[tuple[float, float]] = field(default_factory=list)
    kv_zero_after_s: float | None = None
    settle_s: float = 0.0       # waited before the probe for the stack to be idle again
    duration_s: float = 0.0
    aborted: str | None = None  # why the runner cut the probe short (timeout, RSS cap)
    details: dict[str, Any] = field(default_factory=dict)
    verdict: str = UNCLEAR
    reason: str = ""

    @property
    def rss_delta_mb(self) -> float | None:
        """Peak growth over the probe (what a client could make the gateway hold)."""
        if self.rss_before_mb is None or self.rss_peak_mb is None:
            return None
        return self.rss_peak_mb - self.rss_before_mb

    @property
    def rss_kept_mb(self) -> float | None:
        if self.rss_before_mb is None or self.rss_after_mb is None:
            return None
        return self.rss_after_mb - self.rss_before_mb

    def record_reply(self, reply) -> None:
        """Status, error-JSON check, latency and the body's head from one Reply."""
        self.status = reply.status
        self.latency_s = reply.latency_s
        self.error_json = None if reply.body is None or (isinstance(reply.status, int) and reply.status < 300) \
            else is_openai_error(reply.body)
        self.body_head = reply.head()

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "rss_delta_mb": self.rss_delta_mb, "rss_kept_mb": self.rss_kept_mb}


# --- checks verdicts are made of: each (ok, why) ----------------------------------------------

def client_error_json(r: ProbeResult, allowed: tuple[int, ...] = ()) -> tuple[bool, str]:
    """A 4xx with OpenAI error JSON (or one of `allowed`, e.g. 200 where serving it is fine)."""
    if r.status in allowed:
        return True, f"{r.status} is acceptable"
    if not isinstance(r.status, int):
        return False, f"no HTTP answer ({r.status})"
    if not 400 <= r.status < 500:
        return False, f"{r.status}: expected a 4xx" + (" (a 5xx is a server bug)" if r.status >= 500 else "")
    if not r.error_json:
        return False, f"{r.status} but the body is not OpenAI error JSON"
    return True, f"{r.status} with error JSON"


def health_ok(r: ProbeResult, p50_ms: float = 100.0, max_ms: float = 1000.0) -> tuple[bool, str]:
    if r.health_p50_ms is None:
        return True, "no /health samples"
    if r.health_p50_ms > p50_ms or (r.health_max_ms or 0) > max_ms:
        return False, f"/health p50 {r.health_p50_ms:.0f} ms, max {r.health_max_ms:.0f} ms " \
                      f"(want p50 < {p50_ms:.0f}, max < {max_ms:.0f})"
    return True, f"/health p50 {r.health_p50_ms:.0f} ms, max {r.health_max_ms:.0f} ms"


def rss_ok(r: ProbeResult, max_growth_mb: float) -> tuple[bool, str]:
    delta = r.rss_delta_mb
    if delta is None:
        return True, "RSS not measured"
    if delta > max_growth_mb:
        return False, f"gateway RSS grew {delta:.0f} MB (want < {max_growth_mb:.0f})"
    return True, f"RSS +{delta:.0f} MB"


def all_of(*checks: tuple[bool, str]) -> tuple[bool, str]:
    failed = [why for ok, why in checks if not ok]
    return (False, "; ".join(failed)) if failed else (True, "; ".join(why for _, why in checks))
