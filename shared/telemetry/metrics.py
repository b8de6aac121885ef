"""The duet_* Prometheus metrics, in a registry owned by the process (no global registry).

The router and every worker create one DuetMetrics and serve it with start_metrics_server;
each registers only the families it sets (a router no worker gauges nor token latencies, a
worker no routing decisions), so no series on a /metrics page stays empty for want of an
owner. The gauges are set by their owners (workers); the histograms/counters are observed
where the event happens. Every name, its labels and who sets it: docs/ARCHITECTURE.md,
"Telemetry names" (the HPAs read the worker gauges through prometheus-adapter).
"""
from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, start_http_server)

from shared.telemetry.requests import requests_counter, status_label
from shared.telemetry.token_latency import LatencySeries

# latency buckets: 5 ms .. 60 s (TTFT of a long prompt on CPU is seconds)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


ROUTER = "router"
# the part of a request a worker served, the label of its token latencies: a Prefill call
# (the prompt and its first token), a Generate after a KV handoff (the tokens after the
# first), a Generate whose prompt was computed here too (colocated, or prefilled locally)
PHASES = ("prefill", "decode", "both")


class DuetMetrics:
    """The router's or a worker's metrics, registered in `self.registry` (a fresh
    CollectorRegistry by default): duet_requests_total in both, the routing families in the
    router's, everything else in a worker's."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None, *, process_metrics: bool = True):
        """service: router | prefill | decode | both (a label on duet_requests_total)."""
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        self.requests = requests_counter(r)  # the label scheme every process shares (requests.py)
        if service == ROUTER:
            self.route_decisions = Counter(
                "duet_router_decisions", "Router answers by kind and the reason for it (services/router/placement.py), "
                "and the model routed for", ["kind", "reason", "model"], registry=r)
        else:
            self._worker_families(r)

    def _worker_families(self, r: CollectorRegistry) -> None:
        self.kv_transfer_bytes = Counter(
            "duet_kv_transfer_bytes", "KV cache bytes moved between workers", ["direction"], registry=r)
        self.kv_transfer_seconds = Histogram(
            "duet_kv_transfer_seconds",
            "One request's KV transfer, first page posted to last page landed (spans its prefill: "
            "pages stream out as chunks finish)", buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_handoff_tail_seconds = Histogram(
            "duet_kv_handoff_tail_seconds",
            "What the handoff adds to time to first token: from the prompt's last chunk (first token "
            "sampled) to its last page and the completion notice landing at decode",
            buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_peer_connect_seconds = Histogram(
            "duet_kv_peer_connect_seconds",
            "Prefill side: a decode worker's connection warm-up as it joins (a probe write of the "
            "padding page), so no request pays for transport setup", ["outcome"],
            buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_writes_refused = Counter(
            "duet_kv_writes_refused", "Prefill side: calls refused before any write because their "
            "reservation's write capability did not hold (missing, another writer, a bad signature, "
            "malformed, used already)", ["reason"], registry=r)
        self.kv_notices_refused = Counter(
            "duet_kv_notices_refused", "Decode side: completion notices ignored: for no open reservation "
            "(stale) or without its capability's MAC (forged)", ["reason"], registry=r)
        self.lease_expiries = Counter(
            "duet_lease_expiries", "Leases that lapsed because their holder stopped renewing them: a decode "
            "reservation its gateway no longer renews (reservation), a prefill transfer whose decode worker "
            "left the registry and stopped taking writes (transfer)", ["kind"], registry=r)
        self.kv_cache_usage = Gauge(
            "duet_kv_cache_usage_ratio",
            "Share of KV pages held by live work (running, reserved, awaiting transfer); evictable cache excluded",
            registry=r)
        self.queued_prefill_tokens = Gauge(
            "duet_queued_prefill_tokens", "Prompt tokens waiting for or in prefill", registry=r)
        self.running_requests = Gauge(
            "duet_running_requests", "Requests in the running batch", registry=r)
        self.waiting_requests = Gauge(
            "duet_waiting_requests", "Requests admitted but not yet running", registry=r)
        # a worker's own view of the tokens it serves (shared/telemetry/token_latency.py; observed in
        # services/prefill/service.py and services/decode/generate_timing.py)
        self.time_to_first_token = Histogram(
            "duet_time_to_first_token_seconds", "This worker's view: from a request's call arriving here to "
            "the first token it gave (phase prefill: the token it sampled; decode: its first token sent after a "
            "KV handoff, the wait for the KV included; both: the first token of a prompt computed here)",
            ["phase"], buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "duet_inter_token_latency_seconds", "Time between consecutive tokens this worker sent for a request "
            "(tokens sent together share the gap)", ["phase"], buckets=_ITL_BUCKETS, registry=r)
        self.request_latency = Histogram(
            "duet_e2e_request_latency_seconds", "From a request's call arriving here to its last token sent "
            "(phase prefill: to its answer, the KV handoff included)", ["phase"], buckets=_E2E_BUCKETS, registry=r)
        self._latency: dict[str, LatencySeries] = {}
        # KV that outlives the request: reuse and movement per tier (device, host)
        self.kv_cache_hit_tokens = Counter(
            "duet_kv_cache_hit_tokens", "Prompt tokens whose KV was reused, by the tier it was found in",
            ["tier"], registry=r)
        self.kv_tier_copy_bytes = Counter(
            "duet_kv_tier_copy_bytes", "KV bytes copied between the device and the host tier "
            "(offload: written back, copies given up included; load: brought back for reuse)", ["direction"],
            registry=r)
        # the host tier's write policy (shared/engine/kv_write_policy.py): pages leaving the device
        # with a copy (written: its reason to be kept) or without (dropped: why not)
        self.kv_host_writeback_pages = Counter(
            "duet_kv_host_writeback_pages", "KV pages written back to the host tier (decision written: the "
            "policy's reason) or leaving the device without a copy (dropped: not wanted, or its copy unfinished)",
            ["decision", "reason"], registry=r)
        self.kv_host_writeback_bytes = Counter(
            "duet_kv_host_writeback_bytes", "The bytes of duet_kv_host_writeback_pages (one rank's share under TP)",
            ["decision", "reason"], registry=r)
        self.kv_host_continued_share = Gauge(
            "duet_kv_host_continued_share", "Share of the recently finished requests (distinct prompts) that "
            "continued an earlier one, under the write policy `reused`: from 0.25 (until under 0.2) it keeps first "
            "turns too (reason chat_traffic)", registry=r)
        self.kv_evicted_pages = Counter(
            "duet_kv_evicted_pages", "KV pages evicted, by the tier they left (device pages go to the "
            "host tier when there is one; host pages leave the worker)", ["tier"], registry=r)
        self.kv_host_pages = Gauge(
            "duet_kv_host_cached_pages", "KV pages held in the host tier", registry=r)
        # on a GPU the tier's buffer is page-locked in the background and only locked pages are
        # used: `usable` under `allocated` is a tier still locking (or stopped short: the log says why)
        self.kv_host_tier_pages = Gauge(
            "duet_kv_host_tier_pages", "The host tier's pages: allocated, and usable (page-locked so far)",
            ["state"], registry=r)
        # per-tenant quotas (shared/engine/tenant_quota.py)
        self.kv_tenant_evicted_pages = Counter(
            "duet_kv_tenant_evicted_pages", "Device KV pages evicted from tenants over their cache share, ahead "
            "of other tenants' pages", registry=r)
        self.kv_tenant_passed_over = Counter(
            "duet_kv_tenant_passed_over", "Requests admitted ahead of a waiting request whose tenant held its "
            "share of the KV pages", ["stage"], registry=r)
        self.kv_unaccounted_pages = Gauge(
            "duet_kv_unaccounted_pages", "Pages neither free nor cached, read whenever the worker is "
            "idle (no request, reservation or transfer): anything but 0 is a leak", ["tier"], registry=r)

    # --- helpers used across services -----------------------------------------

    def latency(self, phase: str) -> LatencySeries:
        """A worker's three token-latency histograms for `phase` (one of PHASES); a phase no
        request took shows no series."""
        series = self._latency.get(phase)
        if series is None:
            series = self._latency[phase] = LatencySeries(self.time_to_first_token.labels(phase),
                                                          self.inter_token_latency.labels(phase),
                                                          self.request_latency.labels(phase))
        return series

    def observe_kv_transfer(self, direction: str, num_bytes: int, seconds: float | None = None) -> None:
        """direction: "sent" (prefill side) or "received" (decode side)."""
        self.kv_transfer_bytes.labels(direction=direction).inc(num_bytes)
        if seconds is not None:
            self.kv_transfer_seconds.observe(seconds)

    def request_finished(self, endpoint: str, status) -> None:
        """endpoint: the RPC method; status: the gRPC status the caller got (StatusCode or its name)."""
        outcome, code = status_label(status)
        self.requests.labels(service=self.service, endpoint=endpoint, outcome=outcome, status=code).inc()

    def set_load(self, *, kv_usage: float, queued_prefill_tokens: int, running_requests: int,
                 waiting_requests: int = 0) -> None:
        self.kv_cache_usage.set(kv_usage)
        self.queued_prefill_tokens.set(queued_prefill_tokens)
        self.running_requests.set(running_requests)
        self.waiting_requests.set(waiting_requests)


@dataclass
class MetricsServer:
    server: WSGIServer
    port: int

    @property
    def address(self) -> str:
        return f"{self.server.server_address[0]}:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(metrics: DuetMetrics | CollectorRegistry, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve /metrics on host:port in a daemon thread (port 0 picks a free port)."""
    registry = metrics.registry if isinstance(metrics, DuetMetrics) else metrics
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server=server, port=server.server_port)
