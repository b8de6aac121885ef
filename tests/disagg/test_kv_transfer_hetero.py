"""KV written between workers at different tensor-parallel sizes, re-sharded by heads, with
real NIXL agents (UCX, host memory) in one process: one agent per prefill rank and per
decode rank, each over a pool shaped as the engine's ([pages, heads, layers, 2, page_size,
head_dim], head-major pages) holding that rank's KV heads of one "model" cache.

For each (prefill TP, decode TP, KV heads) case, every prefill rank writes its share of the
head plan (head_plan.py) for one reservation and notifies decode rank 0 (if it wrote anything): every decode
rank's pages then equal the model cache's heads that rank holds, byte for byte; nothing
else in the decode pools changed; the bytes sent equal the reservation's KV on the decode
side; decode rank 0 got one notice per writing prefill rank, each saying how many come; a
head-sliced copy is one descriptor per page (not one per page and layer). Replicated heads are written once per
decode rank, from one replica (spread over them). Layouts that cannot pair are refused
with a reason."""
from __future__ import annotations

import time

import pytest
import torch

from shared.engine.parallel.context import kv_head_slice
from shared.kv_transfer.agent import DONE, PENDING, KvTransferAgent
from shared.kv_transfer.head_plan import PairingError, RankHeads, pairing_problem, plan_head_copies
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.pool_info import PoolInfo
from shared.kv_transfer.write_stream import rank_stream

PAGES, LAYERS, PAGE_SIZE, HEAD_DIM = 12, 3, 4, 8
SRC_PAGES, DST_PAGES = [2, 3, 4, 9, 10], [7, 1, 2, 3, 11]  # a run, a gap, reversed order on decode


def make_agents(prefix: str, tp: int, kv_heads: int, cache: torch.Tensor | None):
    agents = []
    for r in range(tp):
        heads = kv_head_slice(kv_heads, tp, r)
        pool = (cache[:, heads.first:heads.stop].clone() if cache is not None
                else torch.zeros(PAGES, heads.count, LAYERS, 2, PAGE_SIZE, HEAD_DIM))
        agents.append(KvTransferAgent(f"{prefix}-r{r}", pool.contiguous(), write_timeout_s=5,
                                      progress_thread=False, first_head=heads.first))
    return agents


@pytest.mark.parametrize("prefill_tp,decode_tp,kv_heads", [
    (1, 2, 2), (2, 1, 2), (2, 2, 2), (4, 2, 4), (2, 4, 4),  # heads divide
    (2, 1, 1), (1, 2, 1), (2, 4, 2), (4, 1, 2),             # replicated heads on one side or both
])
def test_heads_land_where_the_decode_ranks_hold_them(prefill_tp, decode_tp, kv_heads):
    torch.manual_seed(prefill_tp * 10 + decode_tp)
    cache = torch.randn(PAGES, kv_heads, LAYERS, 2, PAGE_SIZE, HEAD_DIM)
    tag = f"{prefill_tp}{decode_tp}{kv_heads}"
    prefill = make_agents(f"p{tag}", prefill_tp, kv_heads, cache)
    decode = make_agents(f"d{tag}", decode_tp, kv_heads, None)
    try:
        plan = plan_head_copies([a.pool_info for a in prefill], [a.pool_info for a in decode])
        streams = []
        for i, agent in enumerate(prefill):
            peers = {j: agent.add_peer("decode", "n1", d.metadata(), d.pool_info, rank=j) for j, d in enumerate(decode)}
            s = rank_stream(agent, i, peers, plan, DST_PAGES)
            s.write(0, SRC_PAGES[:3])
            s.write(3, SRC_PAGES[3:])
            s.finish(TransferNotice(reservation_id=1, generation=1, rank=i))
            streams.append(s)
        notices = []
        end = time.monotonic() + 10
        writers = sorted({c.src_rank for c in plan})
        while time.monotonic() < end and (any(s.poll() == PENDING for s in streams) or len(notices) < len(writers)):
            notices += decode[0].get_notices()
            for d in decode[1:]:
                d.get_notifs()
            time.sleep(0.002)
        assert [s.state for s in streams] == [DONE] * prefill_tp, [s.error for s in streams]
        assert writers[0] == 0
        assert sorted(n.rank for n in notices) == writers  # one per prefill rank that writes ...
        assert {n.num_ranks for n in notices} == {len(writers)}  # ... and each says how many come
        untouched = [p for p in range(PAGES) if p not in DST_PAGES]
        for j, d in enumerate(decode):
            heads = kv_head_slice(kv_heads, decode_tp, j)
            assert torch.equal(d.pool[DST_PAGES], cache[SRC_PAGES][:, heads.first:heads.stop]), f"decode rank {j}"
            assert d.pool[untouched].abs().sum() == 0
        kv_bytes = len(DST_PAGES) * sum(d.pool_info.page_bytes for d in decode)
        assert sum(s.bytes_sent for s in streams) == sum(n.kv_bytes for n in notices) == kv_bytes
        # every (decode rank, head) pair is written exactly once
        written = sorted((c.dst_rank, c.dst_head + k) for c in plan for k in range(c.num_heads))
        assert written == sorted((j, k) for j, d in enumerate(decode) for k in range(d.pool_info.num_heads))
        if prefill_tp == decode_tp and kv_heads % prefill_tp == 0:
            assert all(c.whole_page and c.src_rank == c.dst_rank for c in plan)  # the plain page-run path
        sliced = [c for c in plan if not c.whole_page]  # one descriptor per page each, whatever the layers
        whole_descriptors = sum(s.num_descriptors for s in streams) - len(sliced) * len(SRC_PAGES)
        assert whole_descriptors == (len(plan) - len(sliced)) * 4  # page runs: 2->7 | 3,4->1,2 ; 9->3 | 10->11
        if prefill_tp > kv_heads:  # replicas share the reading: more than one prefill rank writes
            assert len({c.src_rank for c in plan}) == min(prefill_tp, max(decode_tp, kv_heads))
    finally:
        for a in prefill + decode:
            a.close()


def test_layouts_that_cannot_pair_say_why():
    two = [RankHeads(0, 1, 4, 64), RankHeads(1, 1, 4, 64)]
    assert pairing_problem(two, [RankHeads(0, 2, 4, 64)]) == ""
    assert "no prefill rank holds" in pairing_problem([RankHeads(0, 1, 4, 64)], [RankHeads(0, 2, 4, 64)])
    assert "bytes per head differ" in pairing_problem(two, [RankHeads(0, 2, 4, 32)])
    with pytest.raises(PairingError, match="KV head 1"):
        plan_head_copies([PoolInfo(0, 256, 4, blocks=4, num_heads=1, first_head=0)],
                         [PoolInfo(0, 512, 4, blocks=4, num_heads=2, first_head=0)])
