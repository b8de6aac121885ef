"""rms_norm (plain and fused with the residual add): Triton vs the torch
reference, and the reference vs a float64 formula and HF's LlamaRMSNorm."""

import pytest
import torch

from kernels.rms_norm import rms_norm_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import ELEMENTWISE_TOLERANCE, case_generator, kernel_dtypes

TARGET = "kernels.rms_norm:rms_norm"
CUDA = torch.cuda.is_available()


def _inputs(rows, width, dtype, device):
    g = case_generator(rows, width, dtype)
    x = (torch.randn(rows, width, generator=g) * 3).to(device, dtype)
    residual = torch.randn(rows, width, generator=g).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("rows,width", [(1, 64), (7, 1000), (33, 4096)])
@pytest.mark.parametrize("fused", [False, True])
def test_triton_matches_reference(runner, dtype, rows, width, fused):
    x, residual, weight = _inputs(rows, width, dtype, runner.device)
    out = fill_nan_(torch.empty_like(x))
    if fused:
        h = fill_nan_(torch.empty_like(x))
        runner(TARGET, x, weight, 1e-6, residual, out=out, residual_out=h)
        ref_out, ref_h = rms_norm_reference(x, weight, 1e-6, residual)
        assert torch.equal(h, ref_h)  # the add is rounded to dtype the same way
    else:
        runner(TARGET, x, weight, 1e-6, out=out)
        ref_out = rms_norm_reference(x, weight, 1e-6)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref_out) < ELEMENTWISE_TOLERANCE[dtype]


def test_fused_in_place_residual_and_3d_input(runner):
    x, residual, weight = _inputs(12, 256, torch.float32, runner.device)
    x3, r3 = x.view(3, 4, 256), residual.clone().view(3, 4, 256)
    out, h = runner(TARGET, x3, weight, 1e-5, r3, residual_out=r3)
    ref_out, ref_h = rms_norm_reference(x3, weight, 1e-5, residual.view(3, 4, 256))
    assert out.shape == (3, 4, 256)
    assert torch.equal(r3, ref_h) and torch.equal(h, ref_h)
    assert relative_error(out, ref_out) < 1e-5


def test_reference_matches_float64_formula_and_hf():
    x, residual, weight = _inputs(5, 300, torch.float64, torch.device("cpu"))
    ref = rms_norm_reference(x, weight, 1e-6)
    naive = torch.stack([row / (row.pow(2).sum() / row.numel() + 1e-6).sqrt() * weight for row in x])
    assert relative_error(ref, naive) < 1e-6
    _, h = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(h, x + residual)

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(300, eps=1e-6)
    hf.weight.data.copy_(weight.float())
    x32 = x.float()
    assert relative_error(rms_norm_reference(x32, weight.float(), 1e-6), hf(x32).detach()) < 1e-6


@pytest.mark.parametrize("width,group,fused", [(576, 128, True), (4096, 128, False), (200, 64, True), (48, 128, True)])
def test_fp8_rows_are_the_decode_gemms_quantization_of_the_output(runner, width, group, fused):
    """rms_norm_fp8_rows writes what rms_norm writes (out and h to the bit) plus the output
    quantized per row per group exactly as the decode GEMM quantizes x: the same FP8 bytes and
    scales as quantize_rows_reference of that output (partial last groups, a group wider than
    the row, an all-zero row)."""
    from kernels.fp8_decode_gemm import quantize_rows_reference

    dtype = torch.bfloat16
    x, residual, weight = _inputs(5, width, dtype, runner.device)
    x[3] = 0.0
    residual[3] = 0.0
    res = residual if fused else None
    plain = runner(TARGET, x, weight, 1e-6, res)
    out, h, rows = runner("kernels.rms_norm:rms_norm_fp8_rows", x, weight, 1e-6, res, group)
    plain_out = plain[0] if fused else plain
    assert torch.equal(out, plain_out)
    assert (h is not None) == fused and (not fused or torch.equal(h, plain[1]))
    q_ref, s_ref = quantize_rows_reference(out.cpu(), group)
    assert rows.group == group and rows.q.shape == (5, width) and rows.scales.shape == (5, -(-width // group))
    assert torch.equal(rows.q.cpu().view(torch.uint8), q_ref.to(rows.q.dtype).view(torch.uint8))
    assert torch.equal(rows.scales.cpu(), s_ref)
    assert rows.q[3].float().abs().sum() == 0
    from kernels.rms_norm import rms_norm_fp8_rows_reference
    ref_out, _, ref_rows = rms_norm_fp8_rows_reference(x.cpu(), weight.cpu(), 1e-6, None if res is None else res.cpu(),
                                                       group)
    assert relative_error(out.cpu(), ref_out) < ELEMENTWISE_TOLERANCE[dtype]
    assert relative_error(rows.scales.cpu(), ref_rows.scales) < ELEMENTWISE_TOLERANCE[dtype]
