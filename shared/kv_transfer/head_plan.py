"""Which prefill rank writes which KV heads into which decode rank, when the two workers run
at different tensor-parallel sizes.

Each rank's pool holds a contiguous range of global KV heads (PoolInfo.first_head,
num_heads); a page is head-major (each head's K and V of every layer, `blocks` blocks, are
contiguous), so a range of heads is one contiguous byte range of the page. A decode
rank needs every head it holds from some prefill rank that holds it; where a head is
replicated on several prefill ranks (TP above the KV-head count), decode rank j takes it
from holder j mod holders, so the writes spread over the replicas and no byte is sent twice.

The plan is a function of the two sides' head layouts only, so it is computed once per
(prefill layout, decode layout) pair and cached. Equal layouts give one whole-page copy per
rank pair (page-run descriptors); otherwise a copy is one descriptor per page: the head
range is contiguous inside a page on both sides. (With layers outermost, as in a cache kept
one tensor per layer, it would be one per page and layer: 56 for a 28-layer model, each a cost
of its own on the GPU transports.)
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.kv_transfer.descriptors import descriptor_arrays, merge_page_runs
from shared.kv_transfer.pool_info import PoolInfo


class PairingError(ValueError):
    """The two workers' KV layouts cannot be paired (the message says why)."""


@dataclass(frozen=True)
class RankHeads:
    """The head layout of one rank's pool (the part of PoolInfo a plan depends on)."""

    first_head: int
    num_heads: int
    blocks: int
    head_bytes: int

    @classmethod
    def of(cls, pool: PoolInfo) -> "RankHeads":
        return cls(pool.first_head, pool.num_heads, pool.blocks, pool.head_bytes)

    @property
    def stop(self) -> int:
        return self.first_head + self.num_heads


@dataclass(frozen=True)
class HeadCopy:
    """Prefill rank src_rank writes its heads [src_head, +num_heads) (offsets in its pool)
    into decode rank dst_rank's heads [dst_head, +num_heads)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int
    whole_page: bool  # the copy is every head of both pools: whole pages move


def pairing_problem(src: Sequence[RankHeads], dst: Sequence[RankHeads]) -> str:
    """Why these layouts cannot pair ("" when they can)."""
    if not src or not dst:
        return "a worker publishes no KV pools"
    shapes = {(r.blocks, r.head_bytes) for r in (*src, *dst)}
    if len(shapes) != 1:
        return (f"KV blocks per page / bytes per head differ: prefill "
                f"{sorted({(r.blocks, r.head_bytes) for r in src})}, decode "
                f"{sorted({(r.blocks, r.head_bytes) for r in dst})}")
    for j, d in enumerate(dst):
        for h in range(d.first_head, d.stop):
            if not any(s.first_head <= h < s.stop for s in src):
                return f"decode rank {j} holds KV head {h}, which no prefill rank holds"
    return ""


@functools.lru_cache(maxsize=64)
def _plan(src: tuple[RankHeads, ...], dst: tuple[RankHeads, ...]) -> tuple[HeadCopy, ...]:
    problem = pairing_problem(src, dst)
    if problem:
        raise PairingError(problem)
    copies = []
    for j, d in enumerate(dst):
        h = d.first_head
        while h < d.stop:
            holders = [i for i, s in enumerate(src) if s.first_head <= h < s.stop]
            i = holders[j % len(holders)]
            s = src[i]
            n = min(s.stop, d.stop) - h
            copies.append(HeadCopy(i, j, h - s.first_head, h - d.first_head, n,
                                   whole_page=n == s.num_heads == d.num_heads))
            h += n
    return tuple(copies)


def plan_head_copies(src_pools: Sequence[PoolInfo], dst_pools: Sequence[PoolInfo]) -> tuple[HeadCopy, ...]:
    """Every copy from the prefill ranks (src_pools, by rank) to the decode ranks (dst_pools,
    by rank). Raises PairingError if some decode head has no source."""
    return _plan(tuple(RankHeads.of(p) for p in src_pools), tuple(RankHeads.of(p) for p in dst_pools))


def copy_bytes_per_page(copy: HeadCopy, local: PoolInfo) -> int:
    return local.page_bytes if copy.whole_page else local.blocks * copy.num_heads * local.head_bytes


def copy_descriptors(copy: HeadCopy, src_page_ids: Sequence[int], dst_page_ids: Sequence[int],
                     local: PoolInfo, remote: PoolInfo) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 (addr, len, device id) arrays for one copy over page pairs src[i] -> dst[i]."""
    if copy.whole_page:
        return descriptor_arrays(merge_page_runs(src_page_ids, dst_page_ids), local, remote)
    if len(src_page_ids) != len(dst_page_ids):
        raise ValueError(f"{len(src_page_ids)} source pages but {len(dst_page_ids)} destination pages")
    head_span = local.blocks * local.head_bytes  # one head's bytes in a page (every layer's K and V)
    length = copy.num_heads * head_span

    def side(pool: PoolInfo, pages, head: int, device_id: int) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.uint64)
        addr = pool.base_addr + pages * pool.page_bytes + head * head_span
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr, length, device_id
        return out

    return (side(local, src_page_ids, copy.src_head, local.device_id),
            side(remote, dst_page_ids, copy.dst_head, remote.device_id))
