"""What re-sharding KV by heads costs a write, on this machine's host memory (NIXL/UCX):

    python -m loadtest.bench.kv_slices_cpu [--pages 256] [--layers 28] [--heads 4] [--page-size 16]

The same bytes written two ways between two real NIXL agents in one process: whole pages
between pools of equal head layout (what equal TP sizes do: one descriptor per run of
pages), and one rank's heads into pools holding twice as many (prefill TP 2 -> decode TP 1:
one descriptor per page (head-major pages), head_plan.py). Prints ms, GB/s and descriptors.
On the GPUs the same comparison is the handoff tail in GPU_NOTES.md (hetero_tp.py)."""
from __future__ import annotations

import argparse
import time

import torch

from shared.kv_transfer.agent import KvTransferAgent
from shared.kv_transfer.head_plan import plan_head_copies


def _timed_write(src, dst, pages, heads=None, rounds=3) -> tuple[float, int, int]:
    peer = src.add_peer("dst", "n", dst.metadata(), dst.pool_info, rank=0)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        h = src.write_pages(peer, pages, pages, heads=heads)
        while src.poll(h) == "PENDING":
            dst.get_notifs()
        assert h.state == "DONE", h.error
        best = min(best, time.perf_counter() - t)
    return best, h.num_bytes, h.num_descriptors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.kv_slices_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=4, help="KV heads of the writing rank")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args(argv)
    shape = lambda h: (a.pages + 1, h, a.layers, 2, a.page_size, a.head_dim)  # noqa: E731
    pages = list(range(1, a.pages + 1))
    src = KvTransferAgent("src", torch.randn(shape(a.heads)), progress_thread=False)
    same = KvTransferAgent("same", torch.zeros(shape(a.heads)), progress_thread=False)
    wide = KvTransferAgent("wide", torch.zeros(shape(2 * a.heads)), progress_thread=False)
    rows = [("whole pages (equal TP)", *_timed_write(src, same, pages))]
    copy = plan_head_copies([src.pool_info, KvTransferAgent("src1", torch.zeros(shape(a.heads)), progress_thread=False,
                                                            first_head=a.heads).pool_info],
                            [wide.pool_info])[0]
    rows.append(("head slices (TP 2 -> 1)", *_timed_write(src, wide, pages, heads=copy)))
    print(f"\n=== kv_slices_cpu: {a.pages} pages x {a.layers} layers x {a.heads} heads x {a.page_size} tokens, fp32 ===")
    print(f"{'write':<26}{'ms':>9}{'GB/s':>8}{'descriptors':>13}")
    for name, s, nbytes, ndesc in rows:
        print(f"{name:<26}{1e3 * s:>9.1f}{nbytes / s / 1e9:>8.2f}{ndesc:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
