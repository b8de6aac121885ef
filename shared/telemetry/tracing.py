"""OpenTelemetry tracing from the standard OTEL_* environment.

  OTEL_TRACES_EXPORTER=none|console|otlp (comma list allowed). Unset: otlp when an OTLP endpoint
    is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), else none, so a
    laptop's `duet up` does not retry a collector that is not there (no exporter by default).
  OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf and the endpoints: see otlp.py. Both OTLP
    exporters are default dependencies (pyproject.toml).
  OTEL_SERVICE_NAME overrides the default service name; OTEL_SDK_DISABLED=true exports nothing;
  OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG) and OTEL_BSP_* are honoured by the SDK itself.
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

from shared.telemetry.otlp import endpoint_configured, otlp_exporter, otlp_target

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
    try:
        target = otlp_target(env)
        exporter = otlp_exporter(target)
    except ValueError as exc:  # a misspelt protocol: say so loudly, keep serving
        log.error("%s; traces are not exported", exc)
        return None
    except ImportError as exc:  # an install that skipped the default dependencies
        log.error("OTEL_TRACES_EXPORTER=otlp but the OTLP exporter cannot be imported (%s): "
                  "pip install opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http; "
                  "traces are not exported", exc)
        return None
    log.info("exporting traces over OTLP %s to %s", target.protocol, target.endpoint)
    return exporter


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The OTEL_TRACES_EXPORTER entries in force (see the module docstring for the default)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        raw = "otlp" if endpoint_configured(env) else "none"
    names = [n.strip().lower() for n in raw.split(",")]
    return [n for n in names if n and n != "none"]


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
    used = []
    for name in exporter_names(env):
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
