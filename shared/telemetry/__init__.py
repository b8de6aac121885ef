"""Telemetry shared by every Duet service.

Modules (import them directly; this file stays free of imports):
  metrics      DuetMetrics (the duet_* Prometheus metrics, one registry per process)
               and start_metrics_server (HTTP /metrics)
  token_latency  TokenLatency: one request's tokens timed into TTFT, inter-token and e2e histograms
  tracing      setup_tracing: OpenTelemetry SDK from standard OTEL_* env (no exporter by default)
  propagation  W3C trace context into/out of gRPC metadata and HTTP headers
  logs         setup_logging: a service's stderr log at its own --log-level
"""
