"""duet gateway: the OpenAI-compatible HTTP front door (FastAPI on uvicorn).

    python -m services.gateway.main --router-address 127.0.0.1:50051 [--redis-url redis://...]
    python -m services.gateway.main --backend local            # in-process engine, one process

/metrics is served on the API port, or only on --metrics-port when given. With API keys
(--api-keys-file, DUET_API_KEYS) every route but /health, /live and /metrics needs one;
with --tls-cert-file/--tls-key-file it serves HTTPS (services/gateway/http_edge/security_config.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from services.gateway.backends.interface import GenerationBackend
from services.gateway.config import GatewayConfig
from services.gateway.http_edge.cache_namespace import CacheNamespaces
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.served_model import ModelFiles
from shared.telemetry.logs import setup_logging

log = logging.getLogger("duet.gateway")


def read_max_position_embeddings(model_dir: str | Path) -> int | None:
    """The context length in the model's config.json, if it states one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_length(config: GatewayConfig, model_dir: Path) -> int:
    """--max-model-len capped by the model's own limit (the engine applies the same rule)."""
    model_limit = read_max_position_embeddings(model_dir)
    if model_limit is None and config.max_model_len is None:
        raise ValueError(f"{model_dir}/config.json states no context length: pass --max-model-len")
    limits = [v for v in (config.max_model_len, model_limit) if v]
    return min(limits)


def build_backend(config: GatewayConfig, model_dir: Path, served_name: str, max_context: int,
                  metrics: GatewayMetrics, extra_models: list[str] | None = None) -> GenerationBackend:
    if config.backend == "local":
        from services.gateway.backends.local_engine import LocalBackend

        def load_engine():
            from shared.engine import Engine, EngineConfig

            return Engine(EngineConfig(model_dir=str(model_dir), max_model_len=config.max_model_len, lora=config.lora))

        return LocalBackend(load_engine, name=served_name, expected_context_len=max_context)
    from services.gateway.backends.grpc_workers import GrpcBackend, GrpcBackendConfig
    from services.gateway.backends.migration_metrics import MigrationMetrics

    return GrpcBackend(GrpcBackendConfig(
        router_address=config.router_address, redis_url=config.redis_url, model=served_name,
        extra_models=list(extra_models or []), max_context_len=max_context, reserve_timeout_ms=config.reserve_timeout_ms,
        rpc_timeout_s=config.rpc_timeout_s, route_timeout_s=config.route_timeout_s,
        keepalive_s=config.worker_keepalive_s, keepalive_timeout_s=config.worker_keepalive_timeout_s,
        tls=config.security.grpc_tls,
        redis=config.security.redis, migration=config.migration), MigrationMetrics(metrics.registry))


def extra_model_files(config: GatewayConfig) -> list[ModelFiles]:
    """Each --extra-model's name, tokenizer and context length, read from its folder."""
    out = []
    for name, path in config.extra_model_specs():
        model_dir = Path(path)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"--extra-model {path}: no config.json there (an HF model folder)")
        out.append(ModelFiles(name or model_dir.name, PromptBuilder.from_model_dir(model_dir),
                              context_length(config, model_dir)))
    return out


def build_context(config: GatewayConfig) -> GatewayContext:
    from shared.model_files.default_model import resolve_model_dir

    model_dir = resolve_model_dir(config.model)
    served_name = config.served_model_name or model_dir.name
    max_context = context_length(config, model_dir)
    prompts = PromptBuilder.from_model_dir(model_dir)
    extras = extra_model_files(config)
    metrics = GatewayMetrics()
    backend = build_backend(config, model_dir, served_name, max_context, metrics, [m.name for m in extras])
    namespaces = CacheNamespaces.configured(config.security.cache_namespace_key_file,
                                            config.security.shared_cache_salts)
    return GatewayContext(backend, prompts, metrics, served_name, max_context,
                          tool_call_parser=config.tool_call_parser, limits=config.limits,
                          template=config.template, grammar=config.grammar, cache_namespaces=namespaces,
                          lora_loading=config.enable_lora_loading, extra_models=extras)


def main(argv: list[str] | None = None) -> int:
    try:
        config = GatewayConfig.from_argv(argv)
    except ValueError as exc:
        print(f"duet gateway: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)

    import uvicorn

    from services.gateway.http_edge import auth
    from services.gateway.http_edge.app import build_app
    from services.gateway.http_edge.connection_guard import uvicorn_limits
    from services.gateway.http_edge.shared_port import reuse_port_socket
    from shared.model_files.default_model import ModelNotFoundError
    from shared.telemetry.metrics import start_metrics_server
    from shared.telemetry.tracing import setup_tracing

    security = config.security
    try:
        ctx = build_context(config)
        if config.backend == "grpc":
            security.grpc_tls.check("client")
            security.grpc_tls.check_identity("gateway")
        ssl_options = security.uvicorn_ssl_kwargs()
        keys = auth.ApiKeyStore(security.api_keys, security.api_keys_file) if security.auth_enabled else None
    except (ModelNotFoundError, ValueError, OSError) as exc:
        print(f"duet gateway: {exc}", file=sys.stderr)
        return 2
    tracing = setup_tracing("gateway")
    ctx.tracer = tracing.tracer
    app = build_app(ctx, metrics_route=not security.metrics_port)
    if keys is not None:
        auth.install(app, keys, ctx.metrics.registry)
    metrics_server = (start_metrics_server(ctx.metrics.registry, security.metrics_port, config.host)
                      if security.metrics_port else None)
    log.info("serving %s (context %d tokens) on %s://%s:%d with the %s backend; %s; gRPC %s; metrics on %s",
             ", ".join(ctx.models), ctx.max_context_len, "https" if security.https else "http", config.host,
             config.port, config.backend, f"{keys.count} API keys" if keys else "no API keys (open)",
             security.grpc_tls.describe("client"), f"port {security.metrics_port}" if metrics_server else "the API port")
    try:
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level.lower(),
            timeout_graceful_shutdown=config.drain_grace_s, **ssl_options, **uvicorn_limits(config.limits)))
        # several processes on one port (duet up --gateway-processes): each binds it with SO_REUSEPORT
        server.run(sockets=[reuse_port_socket(config.host, config.port)] if config.reuse_port else None)
        if not server.started:  # it could not listen (the port taken): as uvicorn.run, a start-up failure
            return 3
    finally:
        ctx.stop_helpers()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
