"""Router settings: one dataclass, filled from CLI flags with DUET_* environment defaults
(each field declared once, shared/settings)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.perf_model.config import ItlTarget
from shared.registry.config import RegistryConfig
from shared.security.grpc_tls import GrpcTlsConfig
from shared.settings.flags import build_parser, from_args
from shared.settings.spec import nested, setting


@dataclass
class RoutingWeights:
    """Knobs of the routing cost (see policy.py)."""

    prefill_queue_weight: float = setting(
        1.0, flag="--prefill-queue-weight", env="DUET_ROUTER_PREFILL_QUEUE_WEIGHT",
        help="weight of queued prefill tokens against uncached prompt tokens")
    decode_batch_weight: float = setting(
        0.5, flag="--decode-batch-weight", env="DUET_ROUTER_DECODE_BATCH_WEIGHT",
        help="weight of decode batch occupancy against KV usage")
    nominal_decode_batch: int = 256     # batch size that counts as "full" when a worker does not say
    decode_transfer_weight: float = setting(
        1.0, flag="--decode-transfer-weight", env="DUET_ROUTER_DECODE_TRANSFER_WEIGHT",
        help="weight of the prompt share a decode worker does not hold (written to it) against its KV "
             "usage and batch occupancy: 1.0 = holding the whole prompt is worth an empty KV pool")
    decode_transfer_min_tokens: int = setting(
        1024, flag="--decode-transfer-min-tokens", env="DUET_ROUTER_DECODE_TRANSFER_MIN_TOKENS",
        help="the transfer share is counted against at least this many tokens, so a short prompt's "
             "transfer (a chat template's shared head) weighs next to nothing and load decides")
    lora_load_tokens: int = setting(
        256, flag="--lora-load-tokens", env="DUET_ROUTER_LORA_LOAD_TOKENS",
        help="a worker that serves the request's LoRA adapter but must first load it into a device slot counts "
             "this many more prompt tokens to compute (prefill) or not held (decode)")
    # conditional disaggregation: placement.py (predicted), policy.local_prefill_reason (threshold)
    placement: str = setting(
        "predicted", flag="--placement", env="DUET_PLACEMENT", choices=("predicted", "threshold"),
        help="where a prefill runs: predicted = by each option's predicted time to first token and its cost to "
             "the decode worker's inter-token latency (the workers' step-time models; the local-prefill settings "
             "below are bounds); threshold = on the decode worker whenever it is within those bounds")
    local_prefill_min_share: float = setting(
        0.5, flag="--local-prefill-min-share", env="DUET_LOCAL_PREFILL_MIN_SHARE",
        help="local prefill: a decode worker may prefill a prompt itself (with --placement predicted: when that is "
             "predicted faster and within the inter-token target) if it holds at least this share of it ...")
    local_prefill_max_tokens: int = setting(
        512, flag="--local-prefill-max-tokens", env="DUET_LOCAL_PREFILL_MAX_TOKENS",
        help="... and at most this many prompt tokens are left to compute (no prefill worker, no transfer); "
             "0 = always through a prefill worker")
    overflow: bool = setting(
        False, flag="--placement-overflow", env="DUET_PLACEMENT_OVERFLOW",
        help="with --placement predicted: a decode worker also prefills a prompt beyond those bounds when a queue "
             "on the prefill worker puts the split past the first-token target and the decode worker's rows keep "
             "their mean step within the inter-token target (off by default; `duet up` and the k8s planner "
             "component turn it on with the planner: on two H200s it took 4096-token prompts at 12 req/s from "
             "59% to 76% goodput, docs/performance/serving.md)")


@dataclass
class RouterConfig:
    host: str = setting("0.0.0.0", flag="--host", env="DUET_ROUTER_HOST", help="address the gRPC server binds")
    port: int = setting(50050, flag="--port", env="DUET_ROUTER_PORT", help="gRPC port")
    metrics_port: int = setting(9101, flag="--metrics-port", env="DUET_METRICS_PORT", help="HTTP /metrics port, 0 = off")
    model: str = setting("", flag="--model", env="DUET_SERVED_MODEL_NAME",
                         help="served model name (as workers register it) for requests that name none; empty = any. "
                              "Requests that name a model go to that model's workers only")
    registry: RegistryConfig = nested(RegistryConfig)
    tls: GrpcTlsConfig = nested(GrpcTlsConfig, "gRPC TLS (between gateway, router and workers)")
    weights: RoutingWeights = nested(RoutingWeights)
    slo: ItlTarget = nested(ItlTarget)
    inflight_ttl_s: float = setting(
        60.0, flag="--inflight-ttl", env="DUET_ROUTER_INFLIGHT_TTL",
        help="seconds a routed request counts in the router's own load account unless released first (a "
             "gateway that died, a Route nobody followed up); workers' heartbeats report real load")
    prefix_lookup_timeout_s: float = 0.2  # budget for the Redis page-hash lookup per route
    grace_s: float = 5.0                # drain time for in-flight RPCs on shutdown
    log_level: str = setting("info", flag="--log-level", env="DUET_LOG_LEVEL", help="stderr log level")

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None):
        return build_parser(cls, env, prog="duet router", description="Duet router: picks prefill/decode workers")

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "RouterConfig":
        return from_args(cls, cls.parser(env).parse_args(argv))
