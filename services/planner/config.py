"""Planner settings: one dataclass, filled from CLI flags with DUET_* environment defaults
(each field declared once, shared/settings)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.perf_model.config import ItlTarget, TtftTarget
from shared.registry.config import RegistryConfig
from shared.security.grpc_tls import GrpcTlsConfig
from shared.settings.flags import build_parser, from_args
from shared.settings.spec import nested, setting


@dataclass
class PlannerTiming:
    """How often the planner looks, over how much history, what keeps it from flapping, and how a
    switch spreads the running batch."""

    interval_s: float = setting(10.0, flag="--planner-interval", env="DUET_PLANNER_INTERVAL",
                                help="seconds between the planner's readings and decisions")
    window_s: float = setting(60.0, flag="--planner-window", env="DUET_PLANNER_WINDOW",
                              help="seconds of readings a decision weighs (restarted after each change of split)")
    dwell_s: float = setting(
        60.0, flag="--planner-dwell", env="DUET_PLANNER_DWELL",
        help="seconds a split stays at least (from the planner's start and from its last change) before it "
             "changes again; also the longest backlog (a burst of queued prompts) the current split is left "
             "to work off before a switch is weighed")
    hysteresis: float = setting(
        0.2, flag="--planner-hysteresis", env="DUET_PLANNER_HYSTERESIS",
        help="a split replaces the current one only if its predicted worst SLO ratio is lower by more than "
             "this share (0.2: by a fifth), and scaling down waits until that much headroom is left")
    headroom_above: float = setting(
        0.75, flag="--planner-headroom-above", env="DUET_PLANNER_HEADROOM_ABOVE",
        help="while the current split meets every target, it is left for one predicted better only when its "
             "worst SLO ratio is above this (a switch drains the requests under way on their old roles and "
             "moves prefill away from the pages it left; with room to spare that costs more than it wins); "
             "0: switch for any margin past the hysteresis")
    hand_over_min: int = setting(
        8, flag="--planner-hand-over-min", env="DUET_PLANNER_HAND_OVER_MIN",
        help="after a switch, a switching worker holding at least this many decoding streams more than its "
             "share of the new split's decoders (all of them when it turns prefill) hands that surplus over: "
             "their gateways continue them on the new split, token for token, so the running batch spreads "
             "over it; 0: every stream finishes where it is")
    min_requests: int = setting(
        20, flag="--planner-min-requests", env="DUET_PLANNER_MIN_REQUESTS",
        help="requests the window must hold before the planner judges a split (less: it keeps the current one)")


@dataclass
class KubeScaling:
    """Scaling the prefill and decode pools (Deployments) in Kubernetes, between their bounds."""

    enabled: bool = setting(
        False, flag="--k8s-scale", env="DUET_PLANNER_K8S_SCALE",
        help="also scale the prefill and decode Deployments through the Kubernetes API (in-cluster service "
             "account), between the bounds below; off: only switch the roles of the workers there are")
    namespace: str = setting("", flag="--k8s-namespace", env="DUET_PLANNER_K8S_NAMESPACE",
                             help="the pools' namespace (default: the service account's)")
    prefill_deployment: str = setting("duet-prefill", flag="--prefill-deployment",
                                      env="DUET_PLANNER_PREFILL_DEPLOYMENT", help="the prefill pool's Deployment")
    decode_deployment: str = setting("duet-decode", flag="--decode-deployment",
                                     env="DUET_PLANNER_DECODE_DEPLOYMENT", help="the decode pool's Deployment")
    prefill_min: int = setting(1, flag="--prefill-min-replicas", env="DUET_PLANNER_PREFILL_MIN_REPLICAS",
                               help="fewest prefill pool pods")
    prefill_max: int = setting(8, flag="--prefill-max-replicas", env="DUET_PLANNER_PREFILL_MAX_REPLICAS",
                               help="most prefill pool pods")
    decode_min: int = setting(1, flag="--decode-min-replicas", env="DUET_PLANNER_DECODE_MIN_REPLICAS",
                              help="fewest decode pool pods")
    decode_max: int = setting(8, flag="--decode-max-replicas", env="DUET_PLANNER_DECODE_MAX_REPLICAS",
                              help="most decode pool pods")

    def __post_init__(self) -> None:
        if not (0 <= self.prefill_min <= self.prefill_max and 0 <= self.decode_min <= self.decode_max):
            raise ValueError("replica bounds must satisfy 0 <= min <= max for each pool")


@dataclass
class PlannerConfig:
    host: str = setting("0.0.0.0", flag="--host", env="DUET_PLANNER_HOST", help="address /metrics binds")
    metrics_port: int = setting(9103, flag="--metrics-port", env="DUET_METRICS_PORT",
                                help="HTTP /metrics port (0: a free one)")
    gateway_metrics: list[str] = setting(
        flag="--gateway-metrics", env="DUET_PLANNER_GATEWAY_METRICS", repeat=True,
        help="a gateway's /metrics URL (http://host:port/metrics); repeatable; a host name with several "
             "addresses (a headless Service) is every gateway replica")
    model: str = setting("", flag="--model", env="DUET_SERVED_MODEL_NAME",
                         help="served model name whose workers to plan (empty: every worker)")
    timing: PlannerTiming = nested(PlannerTiming, "when the planner decides")
    ttft: TtftTarget = nested(TtftTarget)
    slo: ItlTarget = nested(ItlTarget)
    k8s: KubeScaling = nested(KubeScaling, "Kubernetes pool scaling")
    registry: RegistryConfig = nested(RegistryConfig)
    tls: GrpcTlsConfig = nested(GrpcTlsConfig, "gRPC TLS (the planner calls the workers' SetRole)")
    log_level: str = setting("info", flag="--log-level", env="DUET_LOG_LEVEL", help="stderr log level")

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None):
        return build_parser(cls, env, prog="duet planner",
                            description="Duet planner: sets the prefill/decode split from the workers' and "
                                        "gateways' metrics against the TTFT and ITL targets")

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "PlannerConfig":
        return from_args(cls, cls.parser(env).parse_args(argv))
