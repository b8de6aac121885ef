"""Page-id pairs -> few large NIXL descriptors.

A page is one contiguous block in a page-major pool, so a run of consecutive page
ids on both sides (src k, k+1, ... -> dst j, j+1, ...) is one descriptor covering
run_length * page_bytes bytes. Thousands of tiny descriptors cannot reach link speed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.kv_transfer.pool_info import PoolInfo


@dataclass(frozen=True)
class PageRun:
    src_page: int
    dst_page: int
    num_pages: int


def merge_page_runs(src_page_ids: Sequence[int], dst_page_ids: Sequence[int]) -> list[PageRun]:
    """Pair src[i] -> dst[i] and merge neighbours that are consecutive on both sides (order kept)."""
    if len(src_page_ids) != len(dst_page_ids):
        raise ValueError(f"{len(src_page_ids)} source pages but {len(dst_page_ids)} destination pages")
    runs: list[PageRun] = []
    for src, dst in zip(src_page_ids, dst_page_ids):
        src, dst = int(src), int(dst)
        if runs:
            last = runs[-1]
            if src == last.src_page + last.num_pages and dst == last.dst_page + last.num_pages:
                runs[-1] = PageRun(last.src_page, last.dst_page, last.num_pages + 1)
                continue
        runs.append(PageRun(src, dst, 1))
    return runs


def descriptor_arrays(runs: Sequence[PageRun], local: PoolInfo, remote: PoolInfo) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 arrays (addr, len, device id) for the local and remote side of the runs."""
    if local.page_bytes != remote.page_bytes:
        raise ValueError(f"page size mismatch: local {local.page_bytes} B, remote {remote.page_bytes} B")
    n = len(runs)
    src = np.empty((n, 3), dtype=np.uint64)
    dst = np.empty((n, 3), dtype=np.uint64)
    for i, run in enumerate(runs):
        length = run.num_pages * local.page_bytes
        src[i] = (local.base_addr + run.src_page * local.page_bytes, length, local.device_id)
        dst[i] = (remote.base_addr + run.dst_page * remote.page_bytes, length, remote.device_id)
    return src, dst
