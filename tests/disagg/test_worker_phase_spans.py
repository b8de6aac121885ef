"""A worker request's phase spans (services/worker_runtime/phase_spans.py) made after the fact
from the engine's monotonic stamps, through the real OpenTelemetry SDK; and the token-latency
rule every process times its tokens by (shared/telemetry/token_latency.py), into a worker's
real Prometheus registry. The whole stack's spans and series: tests/e2e/test_e2e_duet_up.py."""
from __future__ import annotations

import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.worker_runtime.phase_spans import EpochClock, PhaseTimes, queue_and_compute
from shared.telemetry.metrics import DuetMetrics
from shared.telemetry.token_latency import TokenLatency
from shared.telemetry.tracing import setup_tracing


def tracer_and_spans():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("decode", env={}, extra_exporter=exporter, install_global=False)
    return tracing.tracer, exporter


def test_queue_and_compute_are_children_of_the_request_span_at_the_engines_times():
    tracer, exporter = tracer_and_spans()
    clock = EpochClock()
    now = time.monotonic()
    with tracer.start_as_current_span("decode") as parent:
        times = PhaseTimes(arrived=now - 0.30, scheduled=now - 0.25, computed=now - 0.05, chunks=3)
        queue_and_compute(tracer, parent, times, clock, {"duet.steps": 7})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    queue, compute, decode = spans["queue"], spans["compute"], spans["decode"]
    for child in (queue, compute):
        assert child.parent.span_id == decode.context.span_id and child.context.trace_id == decode.context.trace_id
    assert (queue.start_time, queue.end_time) == (clock.ns(times.arrived), clock.ns(times.scheduled))
    assert (compute.start_time, compute.end_time) == (clock.ns(times.scheduled), clock.ns(times.computed))
    assert abs((compute.end_time - compute.start_time) / 1e9 - 0.20) < 1e-6
    assert dict(compute.attributes) == {"duet.chunks": 3, "duet.steps": 7}
    # the epoch clock puts monotonic stamps on the wall clock the parent span was given
    assert decode.start_time - 10**9 < queue.start_time < decode.end_time


def test_a_request_that_never_ran_has_only_its_queue():
    tracer, exporter = tracer_and_spans()
    now = time.monotonic()
    with tracer.start_as_current_span("prefill") as parent:
        queue_and_compute(tracer, parent, PhaseTimes(now - 0.1, None, now), EpochClock(), {})
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["prefill", "queue"]


def test_token_latency_counts_one_ttft_and_a_gap_per_later_token():
    metrics = DuetMetrics("decode", process_metrics=False)
    value = metrics.registry.get_sample_value
    timing = TokenLatency(metrics.latency("decode"), arrived_at=100.0)
    timing.observe(2, now=100.5)  # TTFT 0.5, and a token that came with the first: 0 after it
    timing.observe(2, now=100.7)  # two tokens in one message: 0.1 each
    timing.observe(0, now=101.0)  # a message without tokens times nothing
    timing.observe(1, now=100.9)
    timing.finish()
    phase = {"phase": "decode"}
    assert value("duet_time_to_first_token_seconds_count", phase) == 1
    assert value("duet_time_to_first_token_seconds_sum", phase) == 0.5
    assert value("duet_inter_token_latency_seconds_count", phase) == timing.tokens - 1 == 4
    assert value("duet_inter_token_latency_seconds_bucket", {**phase, "le": "0.001"}) == 1  # the companion
    assert abs(value("duet_inter_token_latency_seconds_sum", phase) - 0.4) < 1e-9
    assert value("duet_e2e_request_latency_seconds_count", phase) == 1
    assert abs(value("duet_e2e_request_latency_seconds_sum", phase) - 0.9) < 1e-9
    assert value("duet_time_to_first_token_seconds_count", {"phase": "both"}) is None
    TokenLatency(metrics.latency("both"), arrived_at=0.0).finish()  # no token: no end to time
    assert value("duet_e2e_request_latency_seconds_count", {"phase": "both"}) == 0
