"""A handed-off prompt's spans under the request's span: its `queue` and `compute` here and its
`kv_send` (services/prefill/outgoing.py HandoffTimes), for a handoff that ended with its done
notice and for one that failed or was cancelled, whose send span then carries the error."""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.prefill.outgoing import HandoffTimes
from services.worker_runtime.phase_spans import EpochClock, queue_and_compute


def handoff_spans(tracer, parent, times: HandoffTimes, attributes: dict, kv_bytes: int, error: str = "") -> None:
    clock = EpochClock()
    queue_and_compute(tracer, parent, times.phase, clock, attributes)
    send = tracer.start_span("kv_send", context=trace.set_span_in_context(parent),
                             start_time=clock.ns(times.send_started),
                             attributes={"duet.request_id": attributes.get("duet.request_id", ""),
                                         "duet.kv_bytes": kv_bytes, "duet.kv_pages": times.pages})
    if error:
        send.set_status(Status(StatusCode.ERROR, error))
    send.end(end_time=clock.ns(max(times.send_ended, times.send_started)))
