"""Gather whole KV pages into a contiguous staging buffer, and scatter back.

The pool is page-major `[num_pages, *page_shape]`; each page must be
contiguous, but pages may sit at any stride (the pool may be a view). Used by
the KV transfer path to turn scattered pages into one transfer descriptor.
"""

import torch


def _check(pool: torch.Tensor, page_ids: torch.Tensor) -> None:
    if page_ids.dim() != 1:
        raise ValueError("page_ids must be 1-D")
    if pool.dim() < 2 or (pool.shape[0] > 0 and not pool[0].is_contiguous()):
        raise ValueError(f"each page must be contiguous; pool strides are {pool.stride()}")


def _check_staging(pool, page_ids, staging):
    if staging.shape != (page_ids.shape[0], *pool.shape[1:]) or not staging.is_contiguous():
        raise ValueError("staging must be a contiguous [n, *page_shape] tensor")
    if staging.dtype != pool.dtype:
        raise ValueError("staging and pool dtypes differ")


def gather_pages_reference(pool: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    _check(pool, page_ids)
    return pool[page_ids.long()].contiguous()


def scatter_pages_reference(pool: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    _check(pool, page_ids)
    _check_staging(pool, page_ids, staging)
    pool[page_ids.long()] = staging


def gather_pages(pool: torch.Tensor, page_ids: torch.Tensor, out=None) -> torch.Tensor:
    """Triton. Returns a contiguous [n, *page_shape] tensor (out, if given:
    a registered staging buffer)."""
    _check(pool, page_ids)
    from kernels.triton_page_copy import launch_page_copy

    if out is None:
        out = torch.empty((page_ids.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _check_staging(pool, page_ids, out)
    staging = out
    launch_page_copy(pool, page_ids, staging, to_staging=True)
    return staging


def scatter_pages(pool: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Triton. Writes staging[i] into page page_ids[i] of pool, in place."""
    _check(pool, page_ids)
    _check_staging(pool, page_ids, staging)
    from kernels.triton_page_copy import launch_page_copy

    launch_page_copy(pool, page_ids, staging, to_staging=False)
