"""The Adapters gRPC service every worker serves: the gateway loads and unloads LoRA adapters at
run time (its /v1/load_lora_adapter and /v1/unload_lora_adapter). The engine reads and checks the
folder on its own thread (shared/engine/lora/manager.py); the registry entry lists the adapters
with the next heartbeat (services/worker/load_publisher.py)."""
from __future__ import annotations

import logging

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.worker_runtime.context import WorkerContext
from shared.engine.lora.adapter_files import LoraAdapterError
from shared.registry.keys import RegistryKeys

log = logging.getLogger("duet.worker.adapters")


async def load_recorded_adapters(ctx: WorkerContext, keys: RegistryKeys, model: str) -> list[str]:
    """Load the adapters the gateway loaded at run time before this worker started (the registry's
    record for `model`); those it cannot read are logged and skipped. The names loaded."""
    lora = ctx.engine.lora
    if lora is None or ctx.watcher is None:
        return []
    try:
        recorded = await ctx.watcher.client.hgetall(keys.lora_adapters(model))
    except Exception as exc:  # noqa: BLE001 - serve our own --lora adapters without them
        log.warning("could not read the run-time LoRA adapters from the registry: %s", exc)
        return []
    loaded = []
    for raw_name, raw_path in sorted(recorded.items()):
        name, path = (v.decode() if isinstance(v, bytes) else v for v in (raw_name, raw_path))
        if lora.knows(name):
            continue
        try:
            await ctx.loop.acall(lambda: lora.load(name, path))
            loaded.append(name)
        except LoraAdapterError as exc:
            log.warning("run-time LoRA adapter %s not loaded: %s", name, exc)
    return loaded


class AdaptersService(duet_pb2_grpc.AdaptersServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    async def LoadLoraAdapter(self, request: duet_pb2.LoadLoraAdapterRequest, context):
        lora = await self._lora(context)
        name = request.lora_name
        if lora.knows(name):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"worker {self.ctx.worker_id} serves LoRA adapter "
                                                                f"{name!r} already")
        try:
            await self.ctx.loop.acall(lambda: lora.load(name, request.lora_path))
        except LoraAdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._reply(lora)

    async def UnloadLoraAdapter(self, request: duet_pb2.UnloadLoraAdapterRequest, context):
        lora = await self._lora(context)
        if not await self.ctx.loop.acall(lambda: lora.unload(request.lora_name)):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker {self.ctx.worker_id} serves no LoRA adapter "
                                                           f"{request.lora_name!r}")
        log.info("LoRA adapter %s unloaded", request.lora_name)
        return await self._reply(lora)

    async def _lora(self, context):
        lora = self.ctx.engine.lora
        if lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.ctx.worker_id} runs without LoRA slots (start it with --max-loras N)")
        return lora

    async def _reply(self, lora) -> duet_pb2.LoraAdapterReply:
        return duet_pb2.LoraAdapterReply(adapters=await self.ctx.loop.acall(lambda: lora.names))
