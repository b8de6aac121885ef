"""The gateway's Prometheus metrics, in a registry of its own (no process-global state). What a
request's tokens and latencies count carries its base model (`model`: the served name, a LoRA
adapter's parent), so the planner of one model's pool reads that model's figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.telemetry.requests import requests_counter, status_label
from shared.telemetry.token_latency import LatencySeries

# Seconds; TTFT spans queueing and prefill, ITL one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.time_to_first_token = Histogram(
            "duet_time_to_first_token_seconds", "Request arrival to first token, seconds",
            ["endpoint", "model", "adapter"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "duet_inter_token_latency_seconds", "Time between consecutive output tokens, seconds",
            ["endpoint", "model", "adapter"], buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "duet_e2e_request_latency_seconds", "Request arrival to last token, seconds",
            ["endpoint", "model", "adapter"], buckets=E2E_BUCKETS, registry=r)
        self.requests = requests_counter(r)  # the label scheme every process shares
        self.prompt_tokens = Counter(
            "duet_prompt_tokens_total", "Prompt tokens of admitted requests", ["endpoint", "model", "adapter"], registry=r)
        self.generation_tokens = Counter(
            "duet_generation_tokens_total", "Generated tokens", ["endpoint", "model", "adapter"], registry=r)
        self.cached_prompt_tokens = Counter(
            "duet_cached_prompt_tokens_total", "Prompt tokens served from a prefix cache: each answer's "
            "usage cached_tokens", ["endpoint"], registry=r)
        self.inflight = Gauge(
            "duet_gateway_inflight_requests", "Requests being served by this gateway", ["endpoint"], registry=r)
        # the same two by base model, from when a request's model resolved (its body read and
        # checked): the planner of one model's pool reads its arrivals from them
        self.model_requests = Counter(
            "duet_gateway_model_requests", "Finished requests whose model resolved, by base model and HTTP status",
            ["model", "status"], registry=r)
        self.model_inflight = Gauge(
            "duet_gateway_model_inflight_requests", "Requests of a resolved model being served, by base model",
            ["model"], registry=r)

    def latency(self, endpoint: str, model: str, adapter: str) -> LatencySeries:
        """The three token-latency histograms of one request's labels."""
        labels = (endpoint, model, adapter)
        return LatencySeries(self.time_to_first_token.labels(*labels), self.inter_token_latency.labels(*labels),
                             self.e2e_latency.labels(*labels))

    def request_resolved(self, model: str) -> None:
        """The request's base model is known: it counts in flight for that model."""
        self.model_inflight.labels(model).inc()

    def request_finished(self, endpoint: str, status: int, model: str = "") -> None:
        """status: the HTTP status the client got (499 when it left first); model: its base
        model, where it resolved (request_resolved)."""
        outcome, code = status_label(status)
        self.requests.labels(service="gateway", endpoint=endpoint, outcome=outcome, status=code).inc()
        if model:
            self.model_requests.labels(model, code).inc()
            self.model_inflight.labels(model).dec()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
