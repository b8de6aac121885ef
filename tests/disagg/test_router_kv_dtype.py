"""A bf16 KV pool and an FP8 one never pair, and the router says why (real engines for the
layouts, a real Redis registry, real gRPC).

The workers' registry entries carry what services/worker publishes: the KV layout key of
their engine (model_kv_key: the KV dtype is in it), the compat hash made from it, and each
rank's pool as the transfer agent describes it. An FP8 prefill pool with a bf16 decode pool
is refused with "kv dtype bfloat16 vs float8_e4m3fn"; the same FP8 prefill with an FP8
decode pool pairs, and moves half the bytes a page."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.worker.kv_compat import compat_hash, model_kv_key
from shared.kv_transfer.pool_info import PoolInfo
from shared.registry.pairing import pair_problem
from shared.registry.worker_info import RankKvPool, WorkerInfo, WorkerLoad
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)
from tests.disagg.test_router import Cluster


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Tiny model engines: bf16 weights and KV, and bf16 weights with an FP8 KV cache."""
    from shared.engine.engine import Engine
    from tests.helpers.tiny_models import make_tiny_model
    d = make_tiny_model(tmp_path_factory.mktemp("kv-dtype") / "tiny", "qwen3")
    common = dict(model_dir=str(d), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 20)
    return {"bf16": Engine(**common), "fp8": Engine(**common, kv_cache_dtype="fp8_e4m3")}


def _worker(worker_id: str, role: str, engine) -> WorkerInfo:
    layout = model_kv_key(engine)
    pool = PoolInfo.from_tensor(engine.pool.buffer, first_head=engine.kv_heads.first)
    return WorkerInfo(worker_id=worker_id, role=role, address=f"{worker_id}.svc:7000", model="tiny",
                      page_size=engine.layout.page_size, compat_hash=compat_hash("tiny", layout), kv_layout=layout,
                      kv_pools=[RankKvPool(rank=0, agent_name=f"{worker_id}-r0", **pool.as_dict())],
                      load=WorkerLoad(free_pages=100, total_pages=100))


def test_bf16_and_fp8_pools_never_pair_and_the_router_says_why(engines, redis_server):
    fp8_prefill = _worker("p-fp8", "prefill", engines["fp8"])
    bf16_decode = _worker("d-bf16", "decode", engines["bf16"])
    fp8_decode = _worker("d-fp8", "decode", engines["fp8"])
    assert fp8_prefill.kv_layout.endswith("-float8_e4m3fn-heads_first")
    assert bf16_decode.kv_layout.endswith("-bfloat16-heads_first")
    assert fp8_prefill.compat_hash != bf16_decode.compat_hash
    assert fp8_prefill.kv_pools[0].page_bytes * 2 == bf16_decode.kv_pools[0].page_bytes
    problem = pair_problem(fp8_prefill, bf16_decode)
    assert problem.endswith(": kv dtype float8_e4m3fn vs bfloat16"), problem
    assert pair_problem(_worker("p-bf16", "prefill", engines["bf16"]), fp8_decode).endswith(
        ": kv dtype bfloat16 vs float8_e4m3fn")
    assert pair_problem(fp8_prefill, fp8_decode) == ""

    async def scenario():
        async with Cluster(redis_server.url) as c:
            await c.add(fp8_prefill)
            await c.add(bf16_decode)
            await c.wait_live("p-fp8", "d-bf16")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.route()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "p-fp8 -> d-bf16: KV layouts differ" in err.value.details()
            assert "kv dtype float8_e4m3fn vs bfloat16" in err.value.details()
            await c.add(fp8_decode)
            await c.wait_live("d-fp8")
            replies = [await c.route() for _ in range(3)]
            assert {(r.prefill.worker_id, r.decode.worker_id) for r in replies} == {("p-fp8", "d-fp8")}

    asyncio.run(scenario())


def test_a_worker_that_lays_pages_out_layers_first_never_pairs(engines):
    """A build from before the page order was named (its key has none: layers first) and this
    one move whole pages whose bytes are ordered differently: they must not pair, and the
    reason names the order."""
    new = _worker("p-new", "prefill", engines["bf16"])
    old = _worker("d-old", "decode", engines["bf16"])
    old.kv_layout = new.kv_layout.removesuffix("-heads_first")
    old.compat_hash = compat_hash("tiny", old.kv_layout)
    assert new.compat_hash != old.compat_hash
    assert pair_problem(new, old).endswith(": page order heads_first vs layers_first"), pair_problem(new, old)
    assert pair_problem(new, _worker("d-new", "decode", engines["bf16"])) == ""
