"""vLLM's endpoints for LoRA adapters at run time: POST /v1/load_lora_adapter {"lora_name",
"lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, answered as vLLM does (200 with a
plain-text line; errors in OpenAI's JSON). Off unless the gateway runs with --enable-lora-loading:
the path is a folder of the workers' file system. Behind the API keys like every /v1 route.
A gateway serving several base models takes the model an adapter is for as `base_model` in the
load body (ours: vLLM serves one model; without it, the default model); an unload goes to every
model's workers that serve the adapter. An adapter is never named like a served
model (its requests would reach the model instead).
The backend tells the workers (backends/grpc_adapters.py) or its own engine (local_engine.py)."""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from services.gateway.backends.interface import AdapterNotFound, BackendError
from services.gateway.http_edge.error_responses import APIError, from_backend_error, invalid_request
from shared.engine.lora.config import check_adapter_name


class LoraAdmin:
    def __init__(self, ctx):
        self.ctx = ctx  # GatewayContext

    async def load(self, request: Request) -> Response:
        try:
            name, path, body = await self._body(request, need_path=True)
            base = self._base_model(body)
            if name in self.ctx.models:
                raise invalid_request(f"'{name}' is the name of a served model, not free for a LoRA adapter",
                                      "lora_name")
            if name in self.ctx.adapters():
                raise invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            await self.ctx.backend.load_adapter(name, path, base)
        except APIError as exc:
            return exc.response()
        except BackendError as exc:
            return from_backend_error(exc).response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            name, _, _ = await self._body(request, need_path=False)  # from every model's workers serving it
            await self.ctx.backend.unload_adapter(name)
        except APIError as exc:
            return exc.response()
        except AdapterNotFound as exc:
            return APIError(404, str(exc), "NotFoundError", "lora_name", "not_found").response()
        except BackendError as exc:
            return from_backend_error(exc).response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: Request, need_path: bool) -> tuple[str, str, dict]:
        """(lora_name, lora_path, the body)."""
        if not self.ctx.lora_loading:
            raise APIError(404, "loading LoRA adapters at run time is off: start the gateway with "
                                "--enable-lora-loading", "invalid_request_error", None, "not_found")
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise invalid_request("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise invalid_request("the body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise invalid_request("lora_name must be a non-empty string", "lora_name")
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise invalid_request(str(exc), "lora_name") from None
        if need_path and (not isinstance(path, str) or not path):
            raise invalid_request("lora_path must be a non-empty string", "lora_path")
        return name, path or "", body

    def _base_model(self, body: dict) -> str:
        """The served model a load is for: `base_model`, the default model when not given."""
        base = body.get("base_model", self.ctx.default_model.name)
        if not isinstance(base, str):
            raise invalid_request("base_model must be a string", "base_model")
        if base not in self.ctx.models:
            raise APIError(404, f"The model '{base}' does not exist.", "invalid_request_error", "base_model",
                           "model_not_found")
        return base
