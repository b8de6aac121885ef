"""A worker request's phases as spans under its request span (`prefill`, `decode`): `queue`
(the engine took the request until a step first computed for it) and `compute` (from there to
its first token on prefill, to its last token sent on decode and `both`).

They are made once the phase has ended, with explicit start and end times, from monotonic
stamps the engine thread already keeps (Req.arrival, Req.scheduled_at): nothing is opened or
touched per token or per step there."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace


@dataclass
class EpochClock:
    """time.monotonic() seconds as the epoch nanoseconds a span's times are given in."""

    offset_ns: int = field(default_factory=lambda: time.time_ns() - time.monotonic_ns())

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.offset_ns


@dataclass
class PhaseTimes:
    """Monotonic seconds: when the engine took the request, a step first computed for it
    (None: never), and the end of its compute; the prefill chunks it took."""

    arrived: float
    scheduled: float | None
    computed: float
    chunks: int = 0

    @classmethod
    def of(cls, req, computed: float) -> "PhaseTimes":
        """From the engine's Req (shared/engine/request.py)."""
        return cls(req.arrival, req.scheduled_at, computed, req.prefill_chunks)


def queue_and_compute(tracer, parent, times: PhaseTimes, clock: EpochClock, attributes: dict) -> None:
    """`queue` and `compute` children of `parent` (the request's span); `attributes` go on
    compute (its tokens, cached tokens, steps). Without a first step, only the queue (to
    `computed`: the request ended waiting)."""
    context = trace.set_span_in_context(parent)
    queued_until = times.scheduled if times.scheduled is not None else times.computed
    queue = tracer.start_span("queue", context=context, start_time=clock.ns(times.arrived))
    queue.end(end_time=clock.ns(max(queued_until, times.arrived)))
    if times.scheduled is None:
        return
    compute = tracer.start_span("compute", context=context, start_time=clock.ns(times.scheduled),
                                attributes={"duet.chunks": times.chunks, **attributes})
    compute.end(end_time=clock.ns(max(times.computed, times.scheduled)))
