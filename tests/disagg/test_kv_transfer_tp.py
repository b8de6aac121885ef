"""TpWriteStream and the follower side (rank_transfers) with four real NIXL agents in one
process (UCX, host memory): prefill ranks 0/1 and decode ranks 0/1, each over its own pool
shard. The follower's calls go straight to its RankTransfers instead of through the TP
control pipe (tests/disagg/test_disagg_tp.py covers the pipe, in real TP processes).

Rank r's pages land in decode rank r's pool, both notices arrive at decode rank 0 with
their ranks and byte counts, the stream is DONE only after both; a follower that cannot
reach its peer fails the whole stream with its error, and an abort still tells decode."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from shared.kv_transfer.agent import DONE, FAILED, PENDING, KvTransferAgent
from shared.kv_transfer.head_plan import plan_head_copies
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.rank_transfers import PeerSpec, RankTransfers
from shared.kv_transfer.tp_write_stream import FollowerStreams, TpWriteStream
from shared.kv_transfer.write_stream import PageWriteStream

POOL_SHAPE = (24, 2, 2, 1, 4, 8)  # one kv head per rank


@dataclass
class InProcessFollowers:
    """Stands where Engine.call_followers stands: runs the follower function on rank 1's state."""

    rank1: RankTransfers
    calls: list = field(default_factory=list)

    def call_followers(self, target: str, *args) -> list:
        module, _, name = target.partition(":")
        assert module == "shared.kv_transfer.rank_transfers" and name == "apply_ops"
        self.calls.append(args[0])
        return [self.rank1.apply(*args)]


@pytest.fixture(scope="module")
def agents():
    made = {name: KvTransferAgent(name, (torch.randn if name.startswith("p") else torch.zeros)(POOL_SHAPE),
                                  write_timeout_s=5, progress_thread=False, first_head=int(name[-1]))
            for name in ("p-r0", "p-r1", "d-r0", "d-r1")}
    yield made
    for a in made.values():
        a.close()


def specs(agents, nonce="n1") -> list[PeerSpec]:
    return [PeerSpec("decode-a", nonce, r, agents[f"d-r{r}"].metadata(), agents[f"d-r{r}"].pool_info)
            for r in (0, 1)]


def drive(stream, followers, agents, notices: list, until=(DONE, FAILED), timeout_s=10.0) -> str:
    """What the engine loops do: prefill flushes follower ops and polls; decode rank 0 reads
    notices (into `notices`), decode rank 1 idles (both progress UCX as targets)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        followers.flush()
        notices += agents["d-r0"].get_notices()
        agents["d-r1"].get_notifs()
        if stream.poll() in until:
            break
        time.sleep(0.002)
    settle = time.monotonic() + 1.0  # notices sent at the end may still be on their way
    while time.monotonic() < settle:
        notices += agents["d-r0"].get_notices()
        time.sleep(0.002)
    return stream.state


def plan(agents):
    return plan_head_copies([agents["p-r0"].pool_info, agents["p-r1"].pool_info],
                            [agents["d-r0"].pool_info, agents["d-r1"].pool_info])


def notice(kind="done") -> TransferNotice:
    return TransferNotice(reservation_id=7, generation=1, rank=0, request_id="r", kind=kind, first_token_id=42,
                          num_tokens=10)


def test_each_rank_writes_its_shard_and_notifies_decode_rank0(agents):
    for a in agents.values():
        if a.name.startswith("d"):
            a.pool.zero_()
    engine = InProcessFollowers(RankTransfers(agents["p-r1"], rank=1))
    followers = FollowerStreams(engine, num_followers=1)
    peers = specs(agents)
    peer0 = agents["p-r0"].add_peer("decode-a", "n1", peers[0].metadata, peers[0].pool, rank=0)
    dst = [3, 4, 5, 9]
    stream = TpWriteStream(PageWriteStream(agents["p-r0"], peer0, dst), followers, peers, dst, plan(agents))
    stream.write(0, [10, 11])
    stream.write(2, [12, 20])
    stream.finish(notice())
    assert stream.poll() == PENDING  # the follower has not even been asked yet
    got: list[TransferNotice] = []
    assert drive(stream, followers, agents, got) == DONE
    for r in (0, 1):
        src, dst_pool = agents[f"p-r{r}"].pool, agents[f"d-r{r}"].pool
        assert torch.equal(dst_pool[[3, 4, 5, 9]], src[[10, 11, 12, 20]]), f"rank {r}'s shard"
    assert agents["d-r1"].pool[[0, 1, 2, 6]].abs().sum() == 0  # nothing else written
    page_bytes = agents["p-r0"].pool_info.page_bytes
    assert sorted((n.rank, n.kind, n.kv_bytes, n.first_token_id) for n in got) == [
        (0, "done", 4 * page_bytes, 42), (1, "done", 4 * page_bytes, 42)]
    assert stream.bytes_sent == 8 * page_bytes
    assert len(engine.calls[0]) == 4 and engine.calls[0][0].kind == "open"  # one batched call for all four ops
    followers.flush()
    assert engine.rank1.streams == {}  # the follower dropped the finished stream


def test_a_follower_that_cannot_reach_its_peer_fails_the_stream_then_abort_reaches_decode(agents):
    engine = InProcessFollowers(RankTransfers(agents["p-r1"], rank=1))
    followers = FollowerStreams(engine, num_followers=1)
    peers = specs(agents, nonce="n2")
    peers[1] = PeerSpec("decode-a", "n2", 1, b"not nixl metadata", peers[1].pool)
    peer0 = agents["p-r0"].add_peer("decode-a", "n2", peers[0].metadata, peers[0].pool, rank=0)
    stream = TpWriteStream(PageWriteStream(agents["p-r0"], peer0, [1, 2]), followers, peers, [1, 2], plan(agents))
    stream.write(0, [5, 6])
    got: list[TransferNotice] = []
    assert drive(stream, followers, agents, got) == FAILED
    assert "rank 1" in stream.error
    assert got == []  # no notice from anyone: the stream never finished
    stream.abort(notice())
    drive(stream, followers, agents, got, until=(DONE,), timeout_s=2)
    assert [(n.rank, n.kind) for n in got] == [(0, "abort")]  # rank 1 never opened: only rank 0 tells
