"""Cross-process KV transfer, wired the way the workers will be: the decode side runs
in its own (spawned) process, publishes its NIXL metadata and pool in a real Redis
registry; the prefill side reads them from there, writes random pages with NIXL,
and sends the completion notice. Then the decode process is killed: writes must
fail cleanly and quickly, never hang."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch

from shared.kv_transfer.agent import DONE, FAILED, KvTransferAgent, TransferError
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.pool_info import PoolInfo
from shared.kv_transfer.write_stream import PageWriteStream
from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.peers import PeerNotFound, connect_sync, fetch_peer_sync
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

POOL_SHAPE = (64, 2, 2, 2, 8, 16)  # [pages, kv_heads, layers, 2, page_size, head_dim]


def registry_config(url: str) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=2.0, heartbeat_interval_s=0.3, scan_interval_s=0.3)


def decode_process(redis_url: str, worker_id: str, results: mp.Queue) -> None:
    """Decode side: register pool + NIXL metadata, then report every notice with the pages it names."""
    from shared.registry.publisher import HeartbeatThread, WorkerPublisher
    from shared.registry.worker_info import RankKvPool, WorkerInfo

    pool = torch.zeros(POOL_SHAPE, dtype=torch.float32)
    agent = KvTransferAgent(f"{worker_id}-r0-{os.getpid()}", pool)
    info = WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1", model="m", page_size=8,
                      kv_pools=[RankKvPool(rank=0, agent_name=agent.name, **agent.pool_info.as_dict())])
    HeartbeatThread(WorkerPublisher(info, registry_config(redis_url), nixl_metadata={0: agent.metadata()})).start()
    while True:  # until killed: the test's "decode dies" step
        for notice in agent.get_notices():
            results.put((notice.__dict__, pool[:8].clone()))  # the test reserves pages 0..7
        time.sleep(0.002)


def test_cross_process_write_notice_and_dead_peer(redis_server):
    config = registry_config(redis_server.url)
    keys = RegistryKeys(config.prefix)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=decode_process, args=(redis_server.url, "decode-x", results), daemon=True)
    child.start()
    src = KvTransferAgent("prefill-x-r0", torch.randn(POOL_SHAPE), write_timeout_s=5)
    try:
        client = connect_sync(config)
        deadline = time.monotonic() + 60
        record = None
        while record is None:
            assert child.is_alive() and time.monotonic() < deadline, "decode process did not register"
            try:
                record = fetch_peer_sync(client, keys, "decode-x")
            except PeerNotFound:
                time.sleep(0.1)
        rank0 = record.info.pool(0)
        peer = src.add_peer("decode-x", record.instance_nonce, record.nixl_metadata[0], PoolInfo.from_record(rank0))
        assert peer.agent_name == rank0.agent_name

        dst_pages = [0, 1, 2, 3, 4, 5, 6, 7]
        src_pages = [9, 10, 11, 30, 31, 50, 2, 3]
        stream = PageWriteStream(src, peer, dst_pages)
        stream.write(0, src_pages[:3])
        stream.write(3, src_pages[3:])
        stream.finish(TransferNotice(reservation_id=5, generation=1, rank=0, first_token_id=42, num_tokens=60))
        end = time.monotonic() + 20
        while stream.poll() == "PENDING" and time.monotonic() < end:
            time.sleep(0.001)
        assert stream.state == DONE, stream.error
        notice, received = results.get(timeout=20)
        assert notice["reservation_id"] == 5 and notice["first_token_id"] == 42
        assert notice["kv_bytes"] == 8 * src.pool_info.page_bytes
        assert torch.equal(received, src.pool[src_pages]), "received pages differ from what was written"

        # decode dies: the next write must fail (raise or FAILED) within the write deadline, never hang
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        t0 = time.monotonic()
        outcome = None
        for _ in range(50):
            try:
                handle = src.write_pages(peer, [1, 2], [1, 2])
            except TransferError as exc:
                outcome = f"refused: {exc}"
                break
            if src.wait(handle, timeout_s=10) == FAILED:
                outcome = f"failed: {handle.error}"
                break
            time.sleep(0.05)  # a write may still complete into the dead process's pages briefly
        elapsed = time.monotonic() - t0
        print(f"dead peer: {outcome} after {elapsed:.3f}s")
        assert outcome is not None, "writes to a dead peer kept succeeding"
        assert elapsed < 10, f"dead peer detected only after {elapsed:.1f}s"
        assert src.inflight == 0
    finally:
        src.close()
        if child.is_alive():
            child.kill()
            child.join(5)
