"""Router settings: one dataclass, filled from CLI flags with DUET_* environment defaults."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.registry.config import RegistryConfig
from shared.security.grpc_tls import GrpcTlsConfig


@dataclass
class RoutingWeights:
    """Knobs of the routing cost (see policy.py)."""

    prefill_queue_weight: float = 1.0   # weight of queued prefill tokens vs. uncached prompt tokens
    decode_batch_weight: float = 0.5    # weight of batch occupancy vs. KV usage for decode
    nominal_decode_batch: int = 256     # batch size that counts as "full" when a worker does not say
    # weight of the prompt share a decode worker does not hold (and would be written to it)
    # against its KV usage and batch occupancy: 1.0 = holding the whole prompt is worth as
    # much as an empty KV pool
    decode_transfer_weight: float = 1.0
    # local prefill (conditional disaggregation): a decode worker holding at least this share
    # of the prompt, with at most this many tokens left to compute, prefills them itself;
    # max tokens 0 turns it off
    local_prefill_min_share: float = 0.5
    local_prefill_max_tokens: int = 512


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 50050
    metrics_port: int = 9101            # 0 = no /metrics server
    model: str = ""                     # default model for requests that name none; "" = any
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)  # gRPC server TLS / mTLS
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    inflight_ttl_s: float = 900.0       # forget a routed request never released (gateway died)
    prefix_lookup_timeout_s: float = 0.2  # budget for the Redis page-hash lookup per route
    grace_s: float = 5.0                # drain time for in-flight RPCs on shutdown
    log_level: str = "info"

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
        env = os.environ if env is None else env
        d = cls.__dataclass_fields__
        p = argparse.ArgumentParser(prog="duet router", description="Duet router: picks prefill/decode workers")
        p.add_argument("--host", default=env.get("DUET_ROUTER_HOST", d["host"].default), help="env DUET_ROUTER_HOST")
        p.add_argument("--port", type=int, default=int(env.get("DUET_ROUTER_PORT", d["port"].default)),
                       help="gRPC port (env DUET_ROUTER_PORT)")
        p.add_argument("--metrics-port", type=int,
                       default=int(env.get("DUET_METRICS_PORT", d["metrics_port"].default)),
                       help="HTTP /metrics port, 0 = off (env DUET_METRICS_PORT)")
        p.add_argument("--model", default=env.get("DUET_SERVED_MODEL_NAME", ""),
                       help="served model name (as workers register it) for requests that name none; "
                            "empty = any (env DUET_SERVED_MODEL_NAME)")
        p.add_argument("--prefill-queue-weight", type=float,
                       default=float(env.get("DUET_ROUTER_PREFILL_QUEUE_WEIGHT", RoutingWeights.prefill_queue_weight)),
                       help="weight of queued prefill tokens against uncached prompt tokens "
                            "(env DUET_ROUTER_PREFILL_QUEUE_WEIGHT)")
        p.add_argument("--decode-batch-weight", type=float,
                       default=float(env.get("DUET_ROUTER_DECODE_BATCH_WEIGHT", RoutingWeights.decode_batch_weight)),
                       help="weight of decode batch occupancy against KV usage (env DUET_ROUTER_DECODE_BATCH_WEIGHT)")
        p.add_argument("--log-level", default=env.get("DUET_LOG_LEVEL", d["log_level"].default),
                       help="env DUET_LOG_LEVEL")
        RegistryConfig.add_args(p, env)
        GrpcTlsConfig.add_args(p, env)
        return p

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "RouterConfig":
        args = cls.parser(env).parse_args(argv)
        return cls(
            host=args.host, port=args.port, metrics_port=args.metrics_port, model=args.model,
            registry=RegistryConfig.from_args(args),
            tls=GrpcTlsConfig.from_args(args),
            weights=RoutingWeights(prefill_queue_weight=args.prefill_queue_weight,
                                   decode_batch_weight=args.decode_batch_weight),
            log_level=args.log_level,
        )
