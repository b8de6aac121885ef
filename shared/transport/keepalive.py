"""HTTP/2 keepalive between the gateway and the workers.

A worker that stops answering without closing its connections (its node dropped off the
network, the process frozen or stopped) sends no reset: a call in flight to it, such as the
one that carries every Generate stream the gateway has open there, would wait forever. The
gateway pings each worker connection every `time_s` while calls are in flight; a ping unanswered
for `timeout_s` ends the connection and its calls with UNAVAILABLE, which the gateway treats as
a lost worker (its streams move on). The workers accept pings that often: gRPC servers by default
answer pings more frequent than every five minutes with GOAWAY ("too many pings")."""
from __future__ import annotations

# the most often a worker accepts pings; the gateway's --worker-keepalive may not go below it
MIN_PING_INTERVAL_S = 1.0


def keepalive_options(time_s: float, timeout_s: float) -> tuple[tuple[str, int], ...]:
    """A client channel's options: ping every time_s (at least MIN_PING_INTERVAL_S) with calls in
    flight, lost after timeout_s without an answer; time_s 0: no pings."""
    if time_s <= 0:
        return ()
    return (("grpc.keepalive_time_ms", int(1000 * max(time_s, MIN_PING_INTERVAL_S))),
            ("grpc.keepalive_timeout_ms", int(1000 * timeout_s)),
            # gRPC's own bound on any ping's answer (a minute by default) cuts a keepalive
            # ping's wait short only when it is the shorter
            ("grpc.http2.ping_timeout_ms", int(1000 * timeout_s)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0))  # a quiet stream still gets its pings


def server_ping_policy() -> tuple[tuple[str, int], ...]:
    """A worker server's options: take a client's pings as often as MIN_PING_INTERVAL_S, with or
    without data moving, never answering them with GOAWAY."""
    return (("grpc.http2.min_recv_ping_interval_without_data_ms", int(1000 * MIN_PING_INTERVAL_S)),
            ("grpc.http2.min_ping_interval_without_data_ms", int(1000 * MIN_PING_INTERVAL_S)),
            ("grpc.http2.max_ping_strikes", 0))
