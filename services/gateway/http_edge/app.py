"""The FastAPI application: routes, OpenAI-shaped errors for anything unrouted, lifespan."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.http_edge.error_responses import APIError, invalid_request, not_found
from services.gateway.http_edge.openapi import install_openapi
from services.gateway.http_edge.request_guard import RequestLimitsMiddleware
from services.gateway.openai_api.endpoints import GatewayContext, OpenAIEndpoints
from services.gateway.openai_api.lora_admin import LoraAdmin


def build_app(ctx: GatewayContext, manage_backend: bool = True, metrics_route: bool = True) -> FastAPI:
    """manage_backend: start the backend with the app and close it at shutdown.
    metrics_route: serve /metrics here (off when it has a port of its own)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.renderer.pool.prestart(1)  # the first chat request need not wait for a helper to start
        if manage_backend:
            await ctx.backend.start()
        try:
            yield
        finally:
            ctx.stop_helpers()
            if manage_backend:
                await ctx.backend.close()

    app = FastAPI(title="Duet gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    endpoints = OpenAIEndpoints(ctx)
    app.state.endpoints = endpoints

    app.add_api_route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", endpoints.completions, methods=["POST"])
    app.add_api_route("/v1/responses", endpoints.responses, methods=["POST"])
    app.add_api_route("/v1/models", endpoints.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", endpoints.get_model, methods=["GET"])
    lora = LoraAdmin(ctx)  # 404 unless --enable-lora-loading
    app.add_api_route("/v1/load_lora_adapter", lora.load, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", lora.unload, methods=["POST"])
    app.add_api_route("/health", endpoints.health, methods=["GET"])
    # Liveness: the process answers HTTP (no API key, nothing about other pods).
    app.add_api_route("/live", lambda: {"status": "alive"}, methods=["GET"])
    if metrics_route:
        app.add_api_route("/metrics", endpoints.prometheus, methods=["GET"])
    install_openapi(app)
    app.add_middleware(RequestLimitsMiddleware, max_bytes=ctx.limits.max_body_bytes,
                       timeout_s=ctx.limits.body_timeout_s, max_header_bytes=ctx.limits.max_header_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return not_found(request.url.path).response()
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return invalid_request(str(exc)).response()

    return app
