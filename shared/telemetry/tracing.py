"""OpenTelemetry tracing from the standard OTEL_* environment.

No exporter unless OTEL_TRACES_EXPORTER says so (DESIGN.md: none by default):
  OTEL_TRACES_EXPORTER=none|console|otlp (comma list allowed)
  OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf, OTEL_EXPORTER_OTLP_ENDPOINT, ... (read by the exporter)
  OTEL_SERVICE_NAME overrides the default service name; OTEL_RESOURCE_ATTRIBUTES,
  OTEL_TRACES_SAMPLER(_ARG) are honoured by the SDK itself.
The OTLP exporter package (opentelemetry-exporter-otlp-proto-grpc or -http) is
optional: without it an `otlp` setting logs a warning and exports nothing.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter)

log = logging.getLogger(__name__)

SERVICE_NAMES = {
    "gateway": "duet-gateway",
    "router": "duet-router",
    "prefill": "duet-prefill",
    "decode": "duet-decode",
    "both": "duet-worker",
}


@dataclass
class Tracing:
    provider: TracerProvider
    tracer: trace.Tracer
    service_name: str
    exporters: list[str]

    def shutdown(self) -> None:
        """Flush and stop span processors (call on clean exit)."""
        self.provider.shutdown()


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    try:
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=otlp but the OTLP exporter package for %r is not installed; "
                    "traces are not exported", protocol)
        return None
    return OTLPSpanExporter()


def setup_tracing(
    role: str,
    *,
    env: Mapping[str, str] | None = None,
    extra_exporter: SpanExporter | None = None,
    install_global: bool = True,
) -> Tracing:
    """Build a TracerProvider for a Duet service.

    role: gateway | router | prefill | decode | both (picks duet-<role> as service name).
    extra_exporter: also send spans here, synchronously (tests use InMemorySpanExporter).
    install_global: make it OpenTelemetry's global provider (once per process; later calls keep the first).
    """
    env = os.environ if env is None else env
    service_name = env.get("OTEL_SERVICE_NAME") or SERVICE_NAMES.get(role, f"duet-{role}")
    resource = Resource.create({SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    used = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            used.append(name)
        elif name == "otlp":
            exporter = _otlp_exporter(env)
            if exporter is not None:
                provider.add_span_processor(BatchSpanProcessor(exporter))
                used.append(name)
        else:
            log.warning("unknown OTEL_TRACES_EXPORTER entry %r ignored", name)
    if extra_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra_exporter))
        used.append(type(extra_exporter).__name__)
    if install_global:
        trace.set_tracer_provider(provider)
    return Tracing(provider=provider, tracer=provider.get_tracer("duet"), service_name=service_name, exporters=used)
