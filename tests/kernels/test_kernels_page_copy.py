"""gather_pages / scatter_pages: Triton vs the torch reference (exact copies)
and the reference vs a page-by-page loop, on a pool that is a strided view."""

import pytest
import torch

from kernels.page_copy import gather_pages_reference, scatter_pages_reference
from tests.helpers.accuracy import fill_nan_
from tests.helpers.kernel_dtypes import kernel_dtypes

CUDA = torch.cuda.is_available()


def _pool(num_pages, page_shape, dtype, device, seed):
    """A view whose pages sit 1 page apart inside a bigger buffer (stride 2 pages)."""
    g = torch.Generator().manual_seed(seed)
    backing = torch.randn(num_pages * 2 + 1, *page_shape, generator=g).to(device, dtype)
    return backing[1::2], backing


def _dtypes():
    return kernel_dtypes(fp16=False)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("page_shape", [(2, 2, 4, 1, 64), (3, 2, 8, 16, 128), (1, 2, 1, 64, 32)])
def test_gather_then_scatter_round_trip(runner, dtype, page_shape):
    pool, backing = _pool(9, page_shape, dtype, runner.device, seed=sum(page_shape))
    page_ids = torch.tensor([7, 0, 3, 8], device=runner.device)
    staging = fill_nan_(torch.empty(4, *page_shape, dtype=dtype, device=runner.device))
    runner("kernels.page_copy:gather_pages", pool, page_ids, out=staging)
    assert torch.equal(staging, gather_pages_reference(pool, page_ids))

    # scatter a fresh payload into other pages; the rest of the backing buffer is untouched
    before = backing.clone()
    payload = torch.randn(2, *page_shape, generator=torch.Generator().manual_seed(1)).to(runner.device, dtype)
    dst = torch.tensor([2, 5], device=runner.device)
    runner("kernels.page_copy:scatter_pages", pool, dst, payload)
    expected = before.clone()
    scatter_pages_reference(expected[1::2], dst, payload)
    assert torch.equal(backing, expected)


def test_reference_matches_page_loop():
    pool, _ = _pool(6, (2, 2, 2, 4, 8), torch.float32, torch.device("cpu"), seed=4)
    ids = torch.tensor([5, 1, 1, 0])
    gathered = gather_pages_reference(pool, ids)
    assert gathered.is_contiguous()
    for i, page in enumerate(ids.tolist()):
        assert torch.equal(gathered[i], pool[page])
    target = pool.clone()
    scatter_pages_reference(target, torch.tensor([3, 4]), gathered[:2])
    assert torch.equal(target[3], pool[5]) and torch.equal(target[4], pool[1])
    assert torch.equal(target[:3], pool[:3])


def test_rejects_pool_with_non_contiguous_pages():
    from kernels.page_copy import gather_pages

    pool = torch.zeros(4, 3, 2, 8)[:, :, 0]  # pages [3, 8] with stride 16 inside
    with pytest.raises(ValueError):
        gather_pages(pool, torch.tensor([1]))
