"""Gateway settings: one dataclass, filled from CLI flags with DUET_* environment defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Mapping

from services.gateway.http_edge.limits_config import GatewayLimits, add_limit_flags, limits_from_args
from services.gateway.http_edge.security_config import SecurityConfig

BACKENDS = ("grpc", "local")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")


@dataclass
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # Where tokens come from: "grpc" (router + prefill/decode workers) or "local" (an
    # in-process engine). Default: grpc when a router address is given, else local.
    backend: str = "local"
    router_address: str | None = None   # host:port of a Router service
    redis_url: str | None = None        # registry: page size for prefix hashes, readiness
    model: str | None = None            # served model folder (HF layout); None = the embedded default
    served_model_name: str | None = None  # name clients send; default = the model folder's name
    max_model_len: int | None = None    # context length; default = the model's config.json
    reserve_timeout_ms: int = 0         # decode admission wait; 0 = decode's default
    rpc_timeout_s: float = 600.0        # bound on each unary RPC (route, reserve, prefill)
    # How tool calls are read out of answers: auto = from the chat template (hermes or
    # llama3_json); none = never (tool_choice "auto" then returns text only)
    tool_call_parser: str = "auto"
    log_level: str = "info"
    security: SecurityConfig = field(default_factory=SecurityConfig)  # API keys, HTTPS, TLS, metrics port
    limits: GatewayLimits = field(default_factory=GatewayLimits)  # admission, body size, slow clients

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "grpc" and not self.router_address:
            raise ValueError("the grpc backend needs --router-address (env DUET_ROUTER_ADDRESS)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
        env = os.environ if env is None else env
        d = cls.__dataclass_fields__
        p = argparse.ArgumentParser(prog="duet-gateway", description="Duet OpenAI-compatible HTTP gateway")
        p.add_argument("--host", default=env.get("DUET_HOST", d["host"].default), help="env DUET_HOST")
        p.add_argument("--port", type=int, default=int(env.get("DUET_PORT", d["port"].default)),
                       help="HTTP port, also serving /metrics unless --metrics-port (env DUET_PORT)")
        p.add_argument("--backend", choices=BACKENDS, default=env.get("DUET_GATEWAY_BACKEND"),
                       help="grpc (router + workers) or local (in-process engine); default grpc when "
                            "--router-address is set (env DUET_GATEWAY_BACKEND)")
        p.add_argument("--router-address", default=env.get("DUET_ROUTER_ADDRESS"),
                       help="Router gRPC host:port (env DUET_ROUTER_ADDRESS)")
        p.add_argument("--redis-url", default=env.get("DUET_REDIS_URL"),
                       help="worker registry, for page size and readiness (env DUET_REDIS_URL)")
        p.add_argument("--model", default=env.get("DUET_MODEL"),
                       help="served model folder; default: the embedded default model (env DUET_MODEL)")
        p.add_argument("--served-model-name", default=env.get("DUET_SERVED_MODEL_NAME"),
                       help="model name clients use (env DUET_SERVED_MODEL_NAME)")
        p.add_argument("--max-model-len", type=int, default=_int_or_none(env.get("DUET_MAX_MODEL_LEN")),
                       help="context length (env DUET_MAX_MODEL_LEN)")
        p.add_argument("--reserve-timeout-ms", type=int,
                       default=int(env.get("DUET_RESERVE_TIMEOUT_MS", d["reserve_timeout_ms"].default)),
                       help="decode admission wait per request (env DUET_RESERVE_TIMEOUT_MS)")
        p.add_argument("--rpc-timeout", type=float,
                       default=float(env.get("DUET_RPC_TIMEOUT", d["rpc_timeout_s"].default)),
                       help="seconds bounding each unary RPC (env DUET_RPC_TIMEOUT)")
        p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                       default=env.get("DUET_TOOL_CALL_PARSER", d["tool_call_parser"].default),
                       help="format of tool calls in answers; auto: from the chat template "
                            "(env DUET_TOOL_CALL_PARSER)")
        p.add_argument("--log-level", default=env.get("DUET_LOG_LEVEL", d["log_level"].default),
                       help="env DUET_LOG_LEVEL")
        SecurityConfig.add_args(p, env)
        add_limit_flags(p, env)
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None, env: Mapping[str, str] | None = None) -> "GatewayConfig":
        args = cls.parser(env).parse_args(argv)
        backend = args.backend or ("grpc" if args.router_address else "local")
        return cls(host=args.host, port=args.port, backend=backend, router_address=args.router_address,
                   redis_url=args.redis_url, model=args.model, served_model_name=args.served_model_name,
                   max_model_len=args.max_model_len, reserve_timeout_ms=args.reserve_timeout_ms,
                   rpc_timeout_s=args.rpc_timeout, tool_call_parser=args.tool_call_parser,
                   log_level=args.log_level, security=SecurityConfig.from_args(args),
                   limits=limits_from_args(args))


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None
