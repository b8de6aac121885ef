"""silu_and_mul: Triton vs the torch reference, reference vs float64 formula."""

import pytest
import torch

from kernels.silu_and_mul import silu_and_mul_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

TARGET = "kernels.silu_and_mul:silu_and_mul"
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 1000), (17, 3072)])
def test_triton_matches_reference(runner, dtype, rows, inter):
    g = case_generator(rows, inter, dtype)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(runner.device, dtype)
    out = fill_nan_(torch.empty(rows, inter, dtype=dtype, device=runner.device))
    runner(TARGET, x, out=out)
    assert torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert relative_error(out, silu_and_mul_reference(x)) < tol


def test_strided_rows(runner):
    """x may be a column slice of a wider buffer (row stride > 2I)."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 700, generator=g).to(runner.device)
    x = wide[:, 50:650]
    got = runner(TARGET, x)
    assert got.shape == (6, 300)
    assert relative_error(got, silu_and_mul_reference(x)) < 1e-5


def test_reference_matches_float64_formula():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 20, generator=g, dtype=torch.float64) * 5
    gate, up = x[:, :10], x[:, 10:]
    naive = gate / (1 + torch.exp(-gate)) * up
    assert relative_error(silu_and_mul_reference(x), naive) < 1e-12
