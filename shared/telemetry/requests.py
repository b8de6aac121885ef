"""duet_requests_total: one counter with one label scheme in every Duet process, so one
query covers the gateway, the router and the workers (sum by (service, outcome) ...).

  service   gateway | router | prefill | decode | both
  endpoint  what was called: the gateway's API route (chat_completions, completions,
            responses), the RPC method elsewhere (Route, Prefill, Reserve, Generate)
  outcome   ok | rejected (the caller's request or no room: 4xx, INVALID_ARGUMENT,
            RESOURCE_EXHAUSTED ...) | error (5xx, UNAVAILABLE, INTERNAL ...) |
            cancelled (the caller left: 499, CANCELLED) | timeout (408/504, DEADLINE_EXCEEDED)
  status    the protocol's own code as the caller saw it: the HTTP status ("200", "429",
            "499") or the gRPC status name ("OK", "UNAVAILABLE")
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

REQUEST_LABELS = ("service", "endpoint", "outcome", "status")
OUTCOMES = ("ok", "rejected", "error", "cancelled", "timeout")
HTTP_CLIENT_CLOSED = 499  # nginx's "client closed request"

_GRPC_REJECTED = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "FAILED_PRECONDITION",
                  "OUT_OF_RANGE", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}


def requests_counter(registry: CollectorRegistry) -> Counter:
    return Counter("duet_requests", "Finished requests by service, endpoint, outcome "
                   "(ok|rejected|error|cancelled|timeout) and protocol status (HTTP code or gRPC status name)",
                   REQUEST_LABELS, registry=registry)


def http_outcome(status: int) -> str:
    if status == HTTP_CLIENT_CLOSED:
        return "cancelled"
    if status in (408, 504):
        return "timeout"
    if status < 400:
        return "ok"
    return "rejected" if status < 500 else "error"


def grpc_outcome(status: str) -> str:
    if status == "OK":
        return "ok"
    if status == "CANCELLED":
        return "cancelled"
    if status == "DEADLINE_EXCEEDED":
        return "timeout"
    return "rejected" if status in _GRPC_REJECTED else "error"


def status_label(status) -> tuple[str, str]:
    """(outcome, status) labels for an HTTP status (int) or a gRPC status (grpc.StatusCode or its name)."""
    if isinstance(status, int):
        return http_outcome(status), str(status)
    name = getattr(status, "name", status)
    return grpc_outcome(name), name
