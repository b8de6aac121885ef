"""The OTLP span exporter the standard OTEL_* variables ask for.

  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL: grpc (default) | http/protobuf
    (http/json is not implemented by the Python exporters: http/protobuf is used, with a warning,
    since collectors take both on the same port)
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: the full URL (http: .../v1/traces as given)
  OTEL_EXPORTER_OTLP_ENDPOINT: the base URL (http: /v1/traces is appended, as the spec says)
  defaults: http://localhost:4317 (grpc), http://localhost:4318/v1/traces (http/protobuf)
Endpoint and protocol are read from the mapping handed to setup_tracing (tests pass their own);
headers, timeout, compression, certificates and OTEL_EXPORTER_OTLP_INSECURE are read by the
exporter itself from the process environment.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/traces"}
TRACES_PATH = "v1/traces"


@dataclass(frozen=True)
class OtlpTarget:
    protocol: str  # grpc | http/protobuf
    endpoint: str


def endpoint_configured(env: Mapping[str, str]) -> bool:
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def otlp_target(env: Mapping[str, str]) -> OtlpTarget:
    raw = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    protocol = raw.strip().lower()
    if protocol == "http/json":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported by the Python OTLP exporter; "
                    "sending http/protobuf to the same endpoint")
        protocol = "http/protobuf"
    elif protocol == "http":
        protocol = "http/protobuf"
    elif protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={raw!r}: expected one of {', '.join(PROTOCOLS)}")
    signal_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if signal_endpoint:
        endpoint = signal_endpoint
    elif base and protocol == "grpc":
        endpoint = base
    elif base:
        endpoint = base.rstrip("/") + "/" + TRACES_PATH
    else:
        endpoint = DEFAULT_ENDPOINTS[protocol]
    return OtlpTarget(protocol, endpoint)


def otlp_exporter(target: OtlpTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=target.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=target.endpoint)
