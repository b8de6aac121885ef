"""Triton kernel behind kernels.page_copy (imported lazily: needs triton)."""

import math

import triton
import triton.language as tl

_BLOCK = 4096  # elements per program; a page is split over several programs


@triton.jit(do_not_specialize_on_alignment=["page_ids"])
def _page_copy_kernel(pool, page_ids, staging, stride_page, page_numel,
                      TO_STAGING: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < page_numel
    page = tl.load(page_ids + i).to(tl.int64)
    pool_ptr = pool + page * stride_page + offs
    stage_ptr = staging + i * page_numel + offs
    if TO_STAGING:
        tl.store(stage_ptr, tl.load(pool_ptr, mask=ok), mask=ok)
    else:
        tl.store(pool_ptr, tl.load(stage_ptr, mask=ok), mask=ok)


def launch_page_copy(pool, page_ids, staging, to_staging: bool) -> None:
    n = page_ids.shape[0]
    page_numel = math.prod(pool.shape[1:])
    if n == 0 or page_numel == 0:
        return
    _page_copy_kernel[(n, triton.cdiv(page_numel, _BLOCK))](
        pool, page_ids, staging, pool.stride(0), page_numel,
        TO_STAGING=to_staging, BLOCK=_BLOCK, num_warps=8,
    )
