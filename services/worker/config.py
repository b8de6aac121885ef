"""Worker settings (prefill, decode or both), from CLI flags and DUET_* environment.

Each field is declared once (shared/settings); the engine's own settings are an EngineConfig
(shared/engine/config.py) held whole, so a new engine setting reaches `duet worker` with no
edit here."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.engine.config import EngineConfig
from shared.perf_model.config import PerfModelConfig
from shared.registry.config import RegistryConfig
from shared.security.grpc_tls import GrpcTlsConfig
from shared.settings import parsers
from shared.settings.drain import drain_grace
from shared.settings.flags import build_parser, from_args
from shared.settings.spec import nested, setting

ROLES = ("prefill", "decode", "both")


@dataclass
class WorkerConfig:
    role: str = setting("both", flag="--role", env="DUET_ROLE", choices=ROLES,
                        help="prefill, decode, or both (whole requests, no KV transfer)")
    switchable: bool = setting(
        False, flag="--switchable", env="DUET_SWITCHABLE",
        help="install every role's parts so the planner can switch this worker between prefill, decode and "
             "both at run time (SetRole) without a restart or losing its KV cache; --role is the role it "
             "advertises first. Under mutual TLS its certificate must name the role `worker`")
    host: str = setting("127.0.0.1", flag="--host", env="DUET_HOST", help="address the gRPC and /metrics servers bind")
    advertise_host: str = setting("", flag="--advertise-host", env="DUET_ADVERTISE_HOST",
                                  help="address other services dial (default: --host, or 127.0.0.1 if 0.0.0.0)")
    port: int = setting(0, flag="--port", env="DUET_PORT", help="gRPC port; 0 = pick a free port")
    metrics_port: int = setting(0, flag="--metrics-port", env="DUET_METRICS_PORT",
                                help="HTTP /metrics port; 0 = pick a free port")
    worker_id: str = setting("", flag="--worker-id", env="DUET_WORKER_ID",
                             help="registry id (default: the role and a random suffix)")
    served_model_name: str = setting("", flag="--served-model-name", env="DUET_SERVED_MODEL_NAME",
                                     help="model name clients use (default: the model folder's name)")
    warmup: bool = setting(True, flag="--warmup", env="DUET_WARMUP",
                           help="before registering, push requests of every shape bucket through the engine (compiles, "
                                "graph pools, allocator) so the first real request is as fast as later ones")
    # a burst of long prompts is not an overload: reservations queue until room frees (each
    # granted as soon as it fits, services/decode/reserve_queue.py), bounded by this deadline
    # (a caller may ask for less, never more) and the queue's length
    reserve_timeout_s: float = setting(60.0, flag="--reserve-timeout", env="DUET_RESERVE_TIMEOUT",
                                       help="decode: seconds a reservation may wait in the queue for KV room "
                                            "(a caller's Reserve timeout is capped by it)")
    reserve_aging_s: float = setting(10.0, flag="--reserve-aging", env="DUET_RESERVE_AGING",
                                     help="decode: a waiting reservation that does not fit yet is passed by "
                                          "later ones that fit until it has waited this many seconds; then "
                                          "nothing passes it until it fits")
    reservation_ttl_s: float = setting(120.0, flag="--reservation-ttl", env="DUET_RESERVATION_TTL",
                                       help="decode: seconds a reservation's write capability lives; one nobody "
                                            "claims by then is quarantined and freed once no write can land (its "
                                            "writer stops writing at the same lifetime), whatever its caller asked")
    # a reservation's holder (the gateway) renews it every third of this; a prefill transfer
    # holds one renewed while its decode worker is in the registry or its writes land
    lease_ttl_s: float = setting(10.0, flag="--lease-ttl", env="DUET_LEASE_TTL",
                                 help="decode: seconds an unclaimed reservation lives unless its holder renews "
                                      "it (RenewLease), then it is quarantined and freed once no write can land; "
                                      "prefill: seconds a transfer goes on while its decode worker is gone from "
                                      "the registry and no write lands, then it is cancelled (0: no leases)")
    reserve_queue_max: int = setting(1024, flag="--reserve-queue-max", env="DUET_RESERVE_QUEUE_MAX",
                                     help="decode: reservations that may wait at once; more are refused at "
                                          "once (429 with Retry-After)")
    notice_timeout_s: float = setting(30.0, flag="--notice-timeout", env="DUET_NOTICE_TIMEOUT",
                                      help="decode: seconds to wait for prefill's KV before recomputing it")
    write_timeout_s: float = setting(20.0, flag="--write-timeout", env="DUET_WRITE_TIMEOUT",
                                     help="prefill: a KV write slower than this many seconds has failed")
    recompute_on_missing_kv: bool = setting(
        True, flag="--recompute", env="DUET_RECOMPUTE",
        help="decode recomputes a request whose KV never arrives (--no-recompute: fail it instead)")
    nixl_progress_thread: bool = setting(
        False, flag="--nixl-progress-thread", env="DUET_NIXL_PROGRESS_THREAD",
        help="run NIXL's UCX progress thread (it busy-spins a core; off: the engine loop progresses "
             "transfers while any is in flight)")
    exit_for_peer_memory: str = setting(
        "auto", flag="--exit-for-peer-memory", env="DUET_EXIT_FOR_PEER_MEMORY", choices=("auto", "on", "off"),
        help="a worker that wrote KV into a peer that then left (died, drained) drains and exits, for its "
             "supervisor to start it again: UCX's cuda_ipc keeps a same-host GPU peer's memory it mapped "
             "allocated until the writer's process exits, so the peer could not start again. auto: when "
             "both pools are GPU memory in one host and PID namespace; on: after any such peer; off: never")
    gil_switch_interval_ms: float | None = setting(
        None, flag="--gil-switch-interval-ms", env="DUET_GIL_SWITCH_INTERVAL_MS", parse=parsers.optional_float,
        help="how long the gRPC thread may hold the GIL before the engine thread takes it back, ms "
             "(auto: 0.2 with the engine on a GPU, Python's 5 on the CPU; 0: Python's)")
    step_timeout_s: float = setting(
        300.0, flag="--step-timeout", env="DUET_STEP_TIMEOUT",
        help="seconds one engine-loop iteration (a step and what follows it) may run before the worker writes every "
             "thread's stack and exits with status 1 for its supervisor to restart it: a GPU call or collective that "
             "never returns otherwise leaves it registered and its streams waiting forever (0 = never)")
    log_level: str = setting("info", flag="--log-level", env="DUET_LOG_LEVEL", help="stderr log level")
    drain_grace_s: float = drain_grace()
    engine: EngineConfig = nested(EngineConfig, "engine (model, KV cache, batching, kernels)")
    perf: PerfModelConfig = nested(PerfModelConfig, "step-time model and inter-token latency target")
    registry: RegistryConfig = nested(RegistryConfig, "registry")
    tls: GrpcTlsConfig = nested(GrpcTlsConfig, "gRPC TLS (between gateway, router and workers)")

    def __post_init__(self) -> None:
        if self.step_timeout_s < 0:
            raise ValueError(f"--step-timeout must be >= 0 (0: no watchdog), got {self.step_timeout_s}")

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None):
        return build_parser(cls, env, prog="duet worker", description="A Duet prefill/decode worker")

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "WorkerConfig":
        return from_args(cls, cls.parser(env).parse_args(argv))

    @property
    def dial_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
