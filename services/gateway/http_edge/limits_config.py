"""The gateway's limits against hostile or runaway load: admission (how many generations
run and wait), request body size, and timeouts for slow clients. One dataclass, filled
from CLI flags with DUET_* environment defaults (GatewayConfig adds the flags). The settings
only: admission.py, request_guard.py (headers, bodies) and connection_guard.py (slow
connections) enforce them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Mapping


@dataclass
class GatewayLimits:
    # Admission: at most max_concurrent requests generate at once, max_queued more wait
    # (FIFO) up to queue_timeout_s for a slot; beyond that 429 with Retry-After. 0 = no bound.
    max_concurrent: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 30.0   # 0 = no deadline
    retry_after_s: float = 1.0
    # Request bodies: larger ones get 413; a body not fully sent within body_timeout_s gets 408.
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    # Connections: headers must arrive within header_timeout_s of the connection opening (or
    # of the previous response), an idle keep-alive connection closes after keep_alive_s,
    # and headers larger than max_header_bytes are refused (slowloris, header floods).
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_header_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        for name in ("header_timeout_s", "keep_alive_s", "max_header_bytes", "max_body_bytes", "body_timeout_s"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0")


# (field, flag, env, type, help)
_FLAGS = (
    ("max_concurrent", "--max-concurrent-requests", "DUET_MAX_CONCURRENT_REQUESTS", int,
     "requests generating at once; 0 = no bound"),
    ("max_queued", "--max-queued-requests", "DUET_MAX_QUEUED_REQUESTS", int,
     "requests waiting for a slot beyond that; more get 429"),
    ("queue_timeout_s", "--queue-timeout", "DUET_QUEUE_TIMEOUT", float,
     "seconds a request waits for a slot before 429"),
    ("retry_after_s", "--retry-after", "DUET_RETRY_AFTER", float, "Retry-After seconds on a 429"),
    ("max_body_bytes", "--max-body-bytes", "DUET_MAX_BODY_BYTES", int, "larger request bodies get 413"),
    ("body_timeout_s", "--body-timeout", "DUET_BODY_TIMEOUT", float,
     "seconds to receive a whole request body before 408"),
    ("header_timeout_s", "--header-timeout", "DUET_HEADER_TIMEOUT", float,
     "seconds to receive a request's headers before the connection is dropped"),
    ("keep_alive_s", "--keep-alive-timeout", "DUET_KEEP_ALIVE_TIMEOUT", float,
     "seconds an idle keep-alive connection stays open"),
    ("max_header_bytes", "--max-header-bytes", "DUET_MAX_HEADER_BYTES", int,
     "request line + headers larger than this are refused"),
)


def add_limit_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    group = parser.add_argument_group("limits (admission, body size, slow clients)")
    defaults = GatewayLimits()
    for name, flag, var, kind, text in _FLAGS:
        group.add_argument(flag, dest=f"limit_{name}", type=kind, default=kind(env.get(var, getattr(defaults, name))),
                           help=f"{text} (env {var}, default {getattr(defaults, name)})")


def limits_from_args(args: argparse.Namespace) -> GatewayLimits:
    return GatewayLimits(**{name: getattr(args, f"limit_{name}") for name, *_ in _FLAGS})
