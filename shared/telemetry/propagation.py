"""W3C trace context (traceparent/tracestate) and baggage through gRPC metadata and HTTP headers.

The propagator is fixed to W3C (not the global one), so every Duet service speaks
the same format whatever OTEL_PROPAGATORS says in one pod.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

W3C_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def inject_grpc_metadata(context: Context | None = None,
                         metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC call metadata carrying the current (or given) span context; existing entries kept."""
    carrier: dict[str, str] = {}
    W3C_PROPAGATOR.inject(carrier, context=context)
    return list(metadata) + [(key.lower(), value) for key, value in carrier.items()]


def extract_grpc_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """Context from incoming gRPC metadata, e.g. `servicer_context.invocation_metadata()`."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):  # binary (-bin) entries carry no W3C context
            continue
        carrier[key.lower()] = value
    return W3C_PROPAGATOR.extract(carrier)


def inject_http_headers(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    headers = {} if headers is None else headers
    W3C_PROPAGATOR.inject(headers, context=context)
    return headers


def extract_http_context(headers: Mapping[str, str]) -> Context:
    """Context from incoming HTTP headers (any case)."""
    return W3C_PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
