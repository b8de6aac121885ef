"""Gateway settings: one dataclass, filled from CLI flags with DUET_* environment defaults
(each field declared once, shared/settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.gateway.backends.migration import MigrationConfig
from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.security_config import SecurityConfig
from services.gateway.openai_api.template_config import ChatTemplateConfig
from shared.engine.grammar_limits import GrammarLimits
from shared.engine.lora.config import LoraConfig
from shared.settings import parsers
from shared.settings.drain import drain_grace
from shared.settings.flags import build_parser, from_args
from shared.settings.spec import nested, setting

BACKENDS = ("grpc", "local")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")


@dataclass
class GatewayConfig:
    host: str = setting("0.0.0.0", flag="--host", env="DUET_HOST", help="address the HTTP server binds")
    port: int = setting(8000, flag="--port", env="DUET_PORT",
                        help="HTTP port, also serving /metrics unless --metrics-port")
    reuse_port: bool = setting(
        False, flag="--reuse-port", env="DUET_GATEWAY_REUSE_PORT",
        help="bind the HTTP port with SO_REUSEPORT, so several gateway processes share it and the kernel "
             "spreads connections over them (duet up --gateway-processes); give each its own --metrics-port")
    # Where tokens come from: "grpc" (router + prefill/decode workers) or "local" (an
    # in-process engine). None: grpc when a router address is given, else local.
    backend: str | None = setting(flag="--backend", env="DUET_GATEWAY_BACKEND", choices=BACKENDS,
                                  help="grpc (router + workers) or local (in-process engine); default grpc when "
                                       "--router-address is set")
    router_address: str | None = setting(flag="--router-address", env="DUET_ROUTER_ADDRESS",
                                         help="Router gRPC host:port")
    redis_url: str | None = setting(flag="--redis-url", env="DUET_REDIS_URL",
                                    help="worker registry, for page size and readiness")
    model: str | None = setting(flag="--model", env="DUET_MODEL",
                                help="served model folder (HF layout); default: the embedded default model")
    served_model_name: str | None = setting(flag="--served-model-name", env="DUET_SERVED_MODEL_NAME",
                                            help="model name clients use; default: the model folder's name")
    # several base models behind one router (served_model.py): each its own tokenizer, chat
    # template and context length, read from its folder; requests go to its workers by name
    extra_models: list[str] = setting(
        flag="--extra-model", env="DUET_EXTRA_MODELS", repeat=True,
        help="another base model this gateway serves beside --model, as PATH (served under the folder's name) "
             "or NAME=PATH, NAME as its workers register it; repeatable. A request names it as `model`; one "
             "that names none gets --model's. Needs --backend grpc")
    max_model_len: int | None = setting(flag="--max-model-len", env="DUET_MAX_MODEL_LEN", parse=parsers.optional_int,
                                        help="context length; default: the model's config.json")
    reserve_timeout_ms: int = setting(0, flag="--reserve-timeout-ms", env="DUET_RESERVE_TIMEOUT_MS",
                                      help="decode admission wait per request; 0 = decode's default")
    rpc_timeout_s: float = setting(600.0, flag="--rpc-timeout", env="DUET_RPC_TIMEOUT",
                                   help="seconds bounding each unary RPC to a worker (reserve, prefill)")
    # HTTP/2 pings on the gateway's connections to the workers: a worker that stops answering
    # without closing its connections (a node off the network, a frozen process) is lost like one
    # that died, instead of its streams waiting forever for a reset that never comes
    worker_keepalive_s: float = setting(10.0, flag="--worker-keepalive", env="DUET_WORKER_KEEPALIVE",
                                        help="seconds between pings on a worker connection with calls in flight "
                                             "(0 = no pings)")
    worker_keepalive_timeout_s: float = setting(
        5.0, flag="--worker-keepalive-timeout", env="DUET_WORKER_KEEPALIVE_TIMEOUT",
        help="seconds a worker has to answer a ping; past it the connection's calls end UNAVAILABLE and their "
             "streams move to another worker")
    route_timeout_s: float = setting(15.0, flag="--route-timeout", env="DUET_ROUTE_TIMEOUT",
                                     help="seconds bounding the router's answer, including the wait for a router being "
                                          "restarted to accept the call again (it answers at once; a router that "
                                          "does not within this is down: 503)")
    # How tool calls are read out of answers: auto = from the chat template (hermes or
    # llama3_json); none = never (tool_choice "auto" then returns text only)
    tool_call_parser: str = setting("auto", flag="--tool-call-parser", env="DUET_TOOL_CALL_PARSER",
                                    choices=TOOL_CALL_PARSERS,
                                    help="format of tool calls in answers; auto: from the chat template")
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_admin.py): every worker
    # (or the local engine) reads the folder it is given, so they are off unless asked for
    enable_lora_loading: bool = setting(
        False, flag="--enable-lora-loading", env="DUET_ENABLE_LORA_LOADING",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies: lora_name, lora_path); "
             "they load a folder of the workers' file system, so give the gateway API keys too")
    log_level: str = setting("info", flag="--log-level", env="DUET_LOG_LEVEL", help="stderr log level")
    drain_grace_s: float = drain_grace()  # uvicorn's graceful shutdown of open streams
    security: SecurityConfig = nested(SecurityConfig, "security")  # API keys, HTTPS, TLS, metrics port
    limits: GatewayLimits = nested(GatewayLimits, "limits (admission, body size, slow clients)")
    template: ChatTemplateConfig = nested(ChatTemplateConfig, "chat template (request options, render budget)")
    grammar: GrammarLimits = nested(GrammarLimits, "structured outputs (grammar size and compile budget)")
    # the in-process engine's adapters; with --backend grpc the workers' own --lora count
    lora: LoraConfig = nested(LoraConfig, "LoRA adapters (--backend local; workers take their own)")
    migration: MigrationConfig = nested(MigrationConfig, "failover (a stream whose worker failed goes on elsewhere)")

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = "grpc" if self.router_address else "local"
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "grpc" and not self.router_address:
            raise ValueError("the grpc backend needs --router-address (env DUET_ROUTER_ADDRESS)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.extra_models and self.backend != "grpc":
            raise ValueError("--extra-model needs --backend grpc (the local engine serves one model)")
        if self.worker_keepalive_s < 0 or self.worker_keepalive_timeout_s <= 0:
            raise ValueError(f"--worker-keepalive must be >= 0 and --worker-keepalive-timeout > 0, got "
                             f"{self.worker_keepalive_s} and {self.worker_keepalive_timeout_s}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    def extra_model_specs(self) -> list[tuple[str, str]]:
        """(served name or "" for the folder's name, folder) of each --extra-model."""
        out = []
        for item in self.extra_models:
            name, sep, path = item.partition("=")
            out.append((name, path) if sep and name and "/" not in name else ("", item))
        return out

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None):
        return build_parser(cls, env, prog="duet gateway", description="Duet OpenAI-compatible HTTP gateway")

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "GatewayConfig":
        return from_args(cls, cls.parser(env).parse_args(argv))
