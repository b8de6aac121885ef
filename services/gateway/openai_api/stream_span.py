"""The `stream` span of a streamed answer: from its first server-sent event handed to the
server to its last, under the request's root span. The events are stamped as they go (a
clock read each); the span is made once the stream closed, with those times."""
from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace


@dataclass
class StreamTimes:
    first_ns: int | None = None  # epoch nanoseconds, what a span's times are given in
    last_ns: int | None = None
    events: int = 0

    def sent(self, event: bytes) -> bytes:
        """Stamp an event on its way out; returns it."""
        now = time.time_ns()
        if self.first_ns is None:
            self.first_ns = now
        self.last_ns = now
        self.events += 1
        return event

    def record(self, tracer, parent, attributes: dict) -> None:
        """The `stream` span under `parent`, when any event went out."""
        if self.first_ns is None:
            return
        span = tracer.start_span("stream", context=trace.set_span_in_context(parent), start_time=self.first_ns,
                                 attributes={"duet.stream.events": self.events, **attributes})
        span.end(end_time=self.last_ns)
