"""NIXL page transfers between two real agents in one process (UCX, host memory)."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shared.kv_transfer.agent import DONE, FAILED, KvTransferAgent, TransferError
from shared.kv_transfer.descriptors import PageRun, merge_page_runs
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.write_stream import PageWriteStream

# page-major [num_pages, kv_heads, num_layers, 2, page_size, head_dim] (kv_pool.py)
POOL_SHAPE = (48, 2, 3, 2, 4, 8)


def make_pool(fill: str) -> torch.Tensor:
    if fill == "random":
        return torch.randn(POOL_SHAPE, dtype=torch.float32)
    return torch.zeros(POOL_SHAPE, dtype=torch.float32)


@pytest.fixture(scope="module")
def agents():
    src = KvTransferAgent("test-prefill-r0", make_pool("random"), write_timeout_s=10)
    dst = KvTransferAgent("test-decode-r0", make_pool("zeros"), write_timeout_s=10)
    yield src, dst
    src.close()
    dst.close()


def wait_notices(agent: KvTransferAgent, count: int, timeout_s: float = 5.0) -> list[TransferNotice]:
    got: list[TransferNotice] = []
    end = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < end:
        got.extend(agent.get_notices())
        time.sleep(0.002)
    return got


def test_merge_page_runs_merges_only_runs_contiguous_on_both_sides():
    runs = merge_page_runs([3, 4, 5, 9, 10, 11, 12, 20], [7, 8, 9, 1, 2, 30, 31, 0])
    assert runs == [PageRun(3, 7, 3), PageRun(9, 1, 2), PageRun(11, 30, 2), PageRun(20, 0, 1)]
    assert merge_page_runs([5, 4], [1, 2]) == [PageRun(5, 1, 1), PageRun(4, 2, 1)]  # descending: no merge
    with pytest.raises(ValueError):
        merge_page_runs([1, 2], [1])


def test_write_random_pages_exact_bytes_and_descriptor_count(agents):
    src, dst = agents
    dst.pool.zero_()
    peer = src.add_peer("decode-1", "nonce-a", dst.metadata(), dst.pool_info)
    assert src.add_peer("decode-1", "nonce-a", b"ignored: cached", dst.pool_info) is peer
    dst_pages = [10, 11, 12, 13, 14, 30, 31, 2, 40, 41, 42, 5]  # runs of 5, 2, 1, 3, 1 on the dst side
    # src contiguous where dst is, except one break inside the 3-run -> 6 descriptors
    src_pages = [20, 21, 22, 23, 24, 1, 2, 47, 8, 9, 33, 0]
    expected_runs = len(merge_page_runs(src_pages, dst_pages))
    assert expected_runs == 6
    before_desc, before_bytes = src.descriptors_posted, src.bytes_sent
    handle = src.write_pages(peer, src_pages, dst_pages)
    assert src.wait(handle, timeout_s=10) == DONE, handle.error
    assert handle.num_descriptors == expected_runs
    assert src.descriptors_posted - before_desc == expected_runs
    page_bytes = src.pool[0].numel() * 4
    assert handle.num_bytes == 12 * page_bytes and src.bytes_sent - before_bytes == 12 * page_bytes
    for s, d in zip(src_pages, dst_pages):
        assert torch.equal(dst.pool[d], src.pool[s]), f"page {s} -> {d} differs"
    untouched = sorted(set(range(dst.pool_info.num_pages)) - set(dst_pages))
    assert int(torch.count_nonzero(dst.pool[untouched])) == 0, "bytes landed outside the destination pages"
    assert src.inflight == 0


def test_write_stream_sends_notice_after_all_writes(agents):
    src, dst = agents
    dst.pool.zero_()
    dst.get_notifs()  # drain
    peer = src.add_peer("decode-1", "nonce-a", dst.metadata(), dst.pool_info)
    reservation_pages = [16, 17, 18, 19, 25, 26]
    stream = PageWriteStream(src, peer, reservation_pages)
    stream.write(0, [3, 4])          # chunk 1 of prefill
    stream.write(2, [5, 6, 7])       # chunk 2: dst 18,19,25 -> merges to 2 descriptors
    stream.write(5, [40])            # last partial page
    assert stream.num_descriptors == 1 + 2 + 1
    stream.finish(TransferNotice(reservation_id=77, generation=3, rank=0, request_id="req-1",
                                 first_token_id=1234, num_tokens=23))
    end = time.monotonic() + 10
    while stream.poll() not in (DONE, FAILED) and time.monotonic() < end:
        time.sleep(0.001)
    assert stream.state == DONE, stream.error
    notices = wait_notices(dst, 1)
    assert len(notices) == 1
    n = notices[0]
    assert (n.reservation_id, n.generation, n.first_token_id, n.kind, n.request_id) == (77, 3, 1234, "done", "req-1")
    assert n.kv_bytes == 6 * src.pool_info.page_bytes == stream.bytes_sent
    for i, s in enumerate([3, 4, 5, 6, 7, 40]):
        assert torch.equal(dst.pool[reservation_pages[i]], src.pool[s])
    with pytest.raises(TransferError):
        stream.write(0, [1])  # finished streams take no more writes


def test_aborted_stream_sends_abort_notice_after_writes_settle(agents):
    src, dst = agents
    dst.get_notifs()
    peer = src.add_peer("decode-1", "nonce-a", dst.metadata(), dst.pool_info)
    stream = PageWriteStream(src, peer, [1, 2, 3, 4])
    stream.write(0, [10, 11])
    stream.abort(TransferNotice(reservation_id=9, generation=2, rank=0, request_id="gone"))
    assert asyncio.run(stream.wait_async(10)) == DONE, stream.error
    notices = wait_notices(dst, 1)
    assert [(n.kind, n.reservation_id, n.generation) for n in notices] == [("abort", 9, 2)]
    assert stream.pages_written == 2


def test_bad_page_ids_and_unknown_peer_are_refused(agents):
    src, dst = agents
    peer = src.add_peer("decode-1", "nonce-a", dst.metadata(), dst.pool_info)
    with pytest.raises(ValueError):
        src.write_pages(peer, [0], [dst.pool_info.num_pages])  # outside the peer's pool
    with pytest.raises(ValueError):
        src.write_pages(peer, [0, 1], [0])
    stream = PageWriteStream(src, peer, [1, 2])
    with pytest.raises(TransferError):
        stream.write(1, [3, 4])  # more pages than the reservation has
    src.remove_peer("decode-1")
    with pytest.raises(TransferError):
        src.write_pages(peer, [0], [0])


def test_changed_nonce_reloads_peer_metadata():
    src = KvTransferAgent("nonce-src", make_pool("random"), write_timeout_s=10)
    old = KvTransferAgent("nonce-dst-gen1", make_pool("zeros"))
    try:
        peer1 = src.add_peer("decode-7", "gen1", old.metadata(), old.pool_info)
        assert src.wait(src.write_pages(peer1, [1], [1]), 10) == DONE
        old.close()
        # the worker restarts at the same registry id: new nonce, new agent, new pool
        new = KvTransferAgent("nonce-dst-gen2", make_pool("zeros"))
        peer2 = src.add_peer("decode-7", "gen2", new.metadata(), new.pool_info)
        assert peer2.agent_name == "nonce-dst-gen2" and src.peer("decode-7") is peer2
        with pytest.raises(TransferError):
            src.write_pages(peer1, [2], [2])  # handle from the old instance is refused
        assert src.wait(src.write_pages(peer2, [2, 3], [5, 6]), 10) == DONE
        assert torch.equal(new.pool[5:7], src.pool[2:4])
        new.close()
    finally:
        src.close()


def test_tp_rank_writes_own_rank_and_notifies_decode_rank0():
    """Prefill rank 1 writes to decode rank 1 and tells decode rank 0 (the scheduler)."""
    src = KvTransferAgent("tp-prefill-r1", make_pool("random"))
    dec0 = KvTransferAgent("tp-decode-r0", make_pool("zeros"))
    dec1 = KvTransferAgent("tp-decode-r1", make_pool("zeros"))
    try:
        to_r1 = src.add_peer("decode-tp", "n1", dec1.metadata(), dec1.pool_info, rank=1)
        to_r0 = src.add_peer("decode-tp", "n1", dec0.metadata(), dec0.pool_info, rank=0)
        assert src.peer("decode-tp", 1) is to_r1 and src.peer("decode-tp", 0) is to_r0
        stream = PageWriteStream(src, to_r1, [7, 8], notice_peer=to_r0)
        stream.write(0, [1, 2])
        stream.finish(TransferNotice(reservation_id=4, generation=1, rank=1, first_token_id=5))
        assert stream.wait(10) == DONE, stream.error
        assert torch.equal(dec1.pool[7:9], src.pool[1:3]) and int(torch.count_nonzero(dec0.pool)) == 0
        notices = wait_notices(dec0, 1)
        assert [(n.rank, n.reservation_id) for n in notices] == [(1, 4)]
        assert dec1.get_notices() == []
        src.remove_peer("decode-tp")  # drops both ranks
        assert src.peer("decode-tp", 0) is None and src.peer("decode-tp", 1) is None
    finally:
        for agent in (src, dec0, dec1):
            agent.close()


def test_a_notice_round_trips_with_its_mac_and_malformed_ones_are_dropped():
    """What arrives over NIXL is checked before the reservation book reads it: a notice is
    MACed by its capability's secret (never sent), and a message of the wrong shape or types
    is not a notice at all (None), so nothing a peer sends can raise in the engine loop."""
    secret = bytes(range(16))
    notice = TransferNotice(reservation_id=3, generation=1, rank=0, request_id="r", kind="done", first_token_id=9,
                            num_tokens=20, kv_bytes=640, num_ranks=1, key=secret)
    raw = notice.encode()
    assert secret not in raw and secret.hex() not in raw.decode()
    got = TransferNotice.decode(raw)
    assert got == TransferNotice(**{**notice.__dict__, "mac": got.mac}) and got.signed_by(secret)
    assert not got.signed_by(bytes(16)) and not got.signed_by(b"")
    tampered = TransferNotice.decode(raw.replace(b'"first_token_id":9', b'"first_token_id":8'))
    assert tampered is not None and not tampered.signed_by(secret)
    for bad in (b'duet1:{"reservation_id":"3","generation":1,"rank":0}', b'duet1:{"reservation_id":3,"generation":1,'
                b'"rank":[0]}', b'duet1:{"reservation_id":3,"generation":1,"rank":0,"mac":5}', b"duet1:[3,1,0]",
                b'duet1:{"reservation_id":true,"generation":1,"rank":0}', b'duet1:{"reservation_id":3,"x":1}',
                b"duet1:not json", b"hello"):
        assert TransferNotice.decode(bad) is None, bad
