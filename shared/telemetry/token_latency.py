"""One request's output tokens as one process sees them go by, timed into the three latency
histograms (time to first token, inter-token latency, end to end).

The gateway times the tokens it hands to its client, a worker the tokens it sends its caller;
both count by the same rule, so the two views compare: the first token is TTFT (from the
request's arrival in that process), each later one adds an inter-token gap (tokens that come
together share the gap since the last ones evenly; the first token's companions come 0 after
it), so a request of N tokens gives one TTFT and N - 1 gaps; the end is arrival to last token.
Observed on the handler's event loop, never on the engine thread."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class LatencySeries:
    """The three histograms of one label set (children resolved once, not per token)."""

    ttft: object  # prometheus_client Histogram (a labelled child)
    itl: object
    e2e: object


@dataclass
class TokenLatency:
    series: LatencySeries
    arrived_at: float  # time.monotonic() at the request's arrival here
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0

    def observe(self, count: int, now: float | None = None) -> None:
        """`count` tokens went by now (a message or an event may carry several)."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_at is None:
            self.first_at = now
            self.series.ttft.observe(now - self.arrived_at)
            gaps, gap = count - 1, 0.0  # its companions came with it
        else:
            gaps, gap = count, (now - self.last_at) / count
        for _ in range(gaps):
            self.series.itl.observe(gap)
        self.last_at = now
        self.tokens += count

    def finish(self) -> None:
        """The request ended here: arrival to its last token (nothing when none went by)."""
        if self.last_at is not None:
            self.series.e2e.observe(self.last_at - self.arrived_at)
