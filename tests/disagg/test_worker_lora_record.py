"""A worker that starts after the gateway loaded LoRA adapters at run time loads them too: it reads
the registry's record (`<prefix>:model:<m>:lora`, written by the gateway, services/gateway/
backends/grpc_adapters.py) on its engine loop before it registers (services/worker_runtime/
adapters.py). Real Redis, a real engine (a tiny model, CPU) on its real EngineLoop; a recorded
folder that no longer reads is skipped with a warning, not a failed start."""
from __future__ import annotations

import asyncio

from services.worker_runtime.adapters import load_recorded_adapters
from services.worker_runtime.context import WorkerContext
from services.worker_runtime.engine_loop import EngineLoop
from shared.engine.engine import Engine
from shared.engine.lora.config import LoraConfig
from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.watcher import WorkerWatcher
from tests.helpers.lora_adapters import save_random_adapter
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)
from tests.helpers.tiny_models import make_tiny_model


def test_a_starting_worker_loads_the_adapters_recorded_at_run_time(redis_server, tmp_path):
    base = make_tiny_model(tmp_path / "tiny", "llama")
    late = save_random_adapter(base, tmp_path / "late", rank=4, seed=1)
    own = save_random_adapter(base, tmp_path / "own", rank=4, seed=2)
    registry = RegistryConfig(redis_url=redis_server.url, prefix="lora-record")
    keys = RegistryKeys(registry.prefix)
    engine = Engine(model_dir=str(base), device="cpu", kv_cache_memory=8 << 20,
                    lora=LoraConfig(adapters=[f"own={own}"]))
    loop = EngineLoop(engine)
    loop.start()

    async def scenario():
        watcher = WorkerWatcher(registry, model="tiny")
        ctx = WorkerContext(config=None, engine=engine, loop=loop, metrics=None, worker_id="w1", instance_nonce="n",
                            compat_hash="c", page_size=engine.layout.page_size, tracer=None, watcher=watcher)
        record = keys.lora_adapters("tiny")
        await watcher.client.hset(record, mapping={"late": str(late), "own": str(own), "gone": str(tmp_path / "x")})
        await watcher.client.hset(keys.lora_adapters("another-model"), "other", str(late))
        try:
            return await load_recorded_adapters(ctx, keys, "tiny")
        finally:
            await watcher.client.aclose()

    try:
        assert asyncio.run(scenario()) == ["late"]
        assert engine.lora.names == ["late", "own"]
        # what the worker publishes as loaded at run time (a gateway restarted with Redis writes the
        # record back from it): the recorded adapter, not its own --lora one
        assert engine.lora.runtime == {"late": str(late)}
        # its own one unloaded and loaded again at run time is a run-time adapter from then on
        assert loop.call(lambda: engine.lora.unload("own")).result(10) and "own" not in engine.lora.runtime
        loop.call(lambda: engine.lora.load("own", str(own))).result(10)
        assert engine.lora.runtime == {"late": str(late), "own": str(own)}
    finally:
        loop.stop()
