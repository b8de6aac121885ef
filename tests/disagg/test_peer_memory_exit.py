"""A worker that wrote into a peer whose memory it keeps mapped drains once that peer leaves
(services/worker_runtime/peer_memory_exit.py): a real redis-server, the registry's publisher
and watcher, two NIXL agents (UCX, host memory) and a real page write. Between GPUs of one host
the mapping is UCX cuda_ipc's, which keeps a dead peer's KV pool allocated until the writer
exits; on this CPU the same rule runs with --exit-for-peer-memory on."""
from __future__ import annotations

import asyncio
import subprocess
from dataclasses import replace
import sys
import time

import redis
import torch

from services.worker_runtime.peer_memory_exit import PeerMemoryExit, ipc_domain, maps_peer_memory
from shared.kv_transfer.agent import DONE, KvTransferAgent
from shared.registry.config import RegistryConfig
from shared.registry.publisher import WorkerPublisher
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import RankKvPool, WorkerInfo
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

TTL_S = 2.0
AFTER_LEAVE_S = 1.5  # past a heartbeat (0.9 s) and a scan (0.1 s): a worker that registers again is back by then
POOL_SHAPE = (8, 2, 2, 2, 4, 8)


def info(worker_id: str, mem_type: str = "VRAM", domain: str = "boot/pid:[1]") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1", model="m", page_size=4,
                      compat_hash="c", ipc_domain=domain,
                      kv_pools=[RankKvPool(rank=0, agent_name=f"{worker_id}-r0", base_addr=4096, page_bytes=512,
                                           num_pages=8, mem_type=mem_type)])


def test_only_gpu_pools_in_one_host_and_pid_namespace_keep_a_mapping():
    mine = "boot/pid:[1]"
    assert maps_peer_memory("auto", mine, True, info("d"))
    assert not maps_peer_memory("auto", mine, True, info("d", domain="other-boot/pid:[1]"))  # another host
    assert not maps_peer_memory("auto", mine, True, info("d", domain="boot/pid:[2]"))  # another pod's namespace
    assert not maps_peer_memory("auto", mine, True, info("d", mem_type="DRAM"))  # host memory: shm, no mapping
    assert not maps_peer_memory("auto", mine, False, info("d"))  # this worker on the CPU
    assert not maps_peer_memory("auto", "", True, info("d", domain=""))  # unknown is never assumed shared
    assert maps_peer_memory("on", mine, False, info("d", mem_type="DRAM", domain=""))
    assert not maps_peer_memory("off", mine, True, info("d"))


def test_the_ipc_domain_is_the_hosts_boot_and_the_pid_namespace():
    here = ipc_domain()
    boot, namespace = here.split("/", 1)
    assert len(boot) == 36 and namespace.startswith("pid:[")
    child = subprocess.run([sys.executable, "-c", "from services.worker_runtime.peer_memory_exit import ipc_domain;"
                            "print(ipc_domain())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == here  # a worker started beside this one shares it


def test_a_written_peer_that_dies_makes_the_writer_drain_once_and_nothing_else_does(redis_server):
    """A peer never written into leaving, and Redis emptied (every entry gone until the next
    heartbeats write them again), drain nothing; the written peer's death drains once."""
    config = RegistryConfig(redis_url=redis_server.url, ttl_s=TTL_S, heartbeat_interval_s=0.1,
                            scan_interval_s=0.1, socket_timeout_s=0.5)
    # the decode workers beat slower than this worker: emptied, the registry holds this worker
    # again some time before the written peer, which is the view a leave would show
    slow_beat = replace(config, heartbeat_interval_s=0.9)
    writer = KvTransferAgent("writer-r0", torch.randn(POOL_SHAPE), write_timeout_s=10)
    target = KvTransferAgent("target-r0", torch.zeros(POOL_SHAPE), write_timeout_s=10)
    written, bystander = info("decode-w", mem_type="DRAM", domain=""), info("decode-b", mem_type="DRAM", domain="")
    me = WorkerInfo(worker_id="prefill-me", role="prefill", address="127.0.0.1:2", model="m", page_size=4,
                    compat_hash="c")
    drains: list[tuple[float, str]] = []

    async def scenario():
        async with WorkerWatcher(config, model="m") as watcher:
            pubs = {w.worker_id: WorkerPublisher(w, config if w is me else slow_beat) for w in (written, bystander, me)}
            for pub in pubs.values():
                await pub.start()
            assert await watcher.wait_for(lambda w: all(w.is_live(i) for i in pubs), timeout=5)
            peer = writer.add_peer("decode-w", written.instance_nonce, target.metadata(), target.pool_info)
            assert writer.wait(writer.write_pages(peer, [1, 2], [3, 4]), 10) == DONE
            assert torch.equal(target.pool[3:5], writer.pool[1:3])
            assert writer.written_peers() == {("decode-w", written.instance_nonce)}
            service = PeerMemoryExit(written=writer.written_peers, workers=watcher.workers,
                                     drain=lambda why: drains.append((time.monotonic(), why)), mode="on",
                                     mine="", mine_on_gpu=False, me="prefill-me", interval_s=0.1,
                                     after_leave_s=AFTER_LEAVE_S)
            service.start()
            await pubs["decode-b"].stop(deregister=True)  # never written into: nothing of it is mapped
            await asyncio.sleep(TTL_S + 0.6)
            seen_gone = False
            for _ in range(10):  # a Redis restarted empty, until the watcher's scan lands in the gap
                redis.Redis.from_url(redis_server.url).flushall()
                if seen_gone := await watcher.wait_for(
                        lambda w: w.is_live("prefill-me") and not w.is_live("decode-w"), timeout=1.0):
                    break
            assert seen_gone, "the watcher never showed the written peer gone while this worker was back"
            assert await watcher.wait_for(lambda w: w.is_live("decode-w") and w.is_live("prefill-me"), timeout=5)
            await asyncio.sleep(AFTER_LEAVE_S + 0.3)
            assert drains == []
            await pubs["decode-w"].stop(deregister=False)  # SIGKILL: heartbeats stop, only the TTL removes it
            died = time.monotonic()
            deadline = died + TTL_S + AFTER_LEAVE_S + 3.0
            while not drains and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a second notice would land by now
            await service.stop()
            assert len(drains) == 1, drains
            at, why = drains[0]
            assert "decode-w" in why
            assert at - died >= AFTER_LEAVE_S  # it waited after noticing (the dead peer's streams move meanwhile)

    try:
        asyncio.run(scenario())
    finally:
        writer.close()
        target.close()
