"""The FP8 decode GEMM (kernels/fp8_decode_gemm.py: 1..32 rows, x quantized per row and group
inside the kernel, FP8 tensor-core dots over TMA weight tiles) against its torch reference on
fresh random inputs: block scales (stacked parts whose scale rows restart, a shard starting
inside a block, a partial last group), per-channel scales, bias, gate/up + SwiGLU, split-K
with the deterministic reduction (the workspace's counters back at zero), rows of any
magnitude and an all-zero row. On the CPU in Triton's interpreter (exact dots); on a GPU the
FP8 MMA's reduced-precision sums inside each 128-column step."""

import pytest
import torch

from kernels.fp8 import Fp8Weight
from kernels.fp8_decode_gemm import Fp8DecodeConfig, fp8_decode_reference
from kernels.small_batch_linear import SmallBatchWorkspace
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import CUDA, case_generator
from tests.kernels.test_kernels_fp8_linear import block_weight, channel_weight, nan_padded_columns

DECODE = "kernels.fp8_decode_gemm:fp8_decode_linear"
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.bfloat16: 1e-2}
SPLIT = Fp8DecodeConfig(block_n=32, num_warps=4, num_stages=1, split_k=3)
NO_SPLIT = Fp8DecodeConfig(block_n=64, num_warps=4, num_stages=1, split_k=1)
PREQUANT = Fp8DecodeConfig(block_n=32, num_warps=4, num_stages=1, split_k=3, prequant=True)


def on(dev, w: Fp8Weight, nan_pad: bool = True) -> Fp8Weight:
    """w on dev; nan_pad: NaN just past each scale row (a step reading a scale column past K
    poisons the output)."""
    scale = nan_padded_columns(w.scale) if nan_pad else w.scale
    return Fp8Weight(w.q.to(dev), scale.to(dev), w.scale_row.to(dev), w.group_k)


def rows_of_every_size(m, k, g, dtype):
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 3, m)[:, None]
    if m > 2:
        x[1] = 0.0  # an all-zero row: its output is the bias
        x[2, 5] = 5e4  # one loud column: only its group's scale is loud
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("config", [SPLIT, NO_SPLIT, PREQUANT, None], ids=["split", "nosplit", "prequant", "default"])
def test_decode_gemm_matches_reference(runner, dtype, m, config):
    g = case_generator("decode", dtype, m, config)
    k = 400  # three whole groups and a partial one of 16 columns
    w = block_weight([48, 24, 24], k, (32, 128), g, "cpu", shard_start=8)
    x = rows_of_every_size(m, k, g, dtype)
    bias = torch.randn(w.q.shape[0], generator=g).to(dtype)
    dev = runner.device
    ws = SmallBatchWorkspace.create(dev, max_partial_floats=1 << 16, max_tiles=64)
    out = fill_nan_(torch.empty(m, w.q.shape[0], dtype=dtype, device=dev))
    runner(DECODE, x.to(dev), on(dev, w), bias.to(dev), out=out, config=config, workspace=ws)
    err = relative_error(out, fp8_decode_reference(x, w, bias))
    assert err < TOL[dtype], err
    if m > 2:
        assert torch.equal(out[1].cpu(), bias), (out[1].cpu() - bias).abs().max()
    assert not ws.counters.any()
    # the activation rounding W8A8 adds, against x times the same dequantized weights
    err = relative_error(out, (x.double() @ w.dequantize(torch.float64).T + bias.double()).to(dtype))
    assert err < 0.06, err
    # gate/up + SwiGLU: the stacked gate and up parts keep their own scale rows
    gu = block_weight([40, 40], k, (32, 128), g, "cpu")
    got = runner(DECODE, x.to(dev), on(dev, gu), config=config, workspace=ws, gate_up=True)
    err = relative_error(got, fp8_decode_reference(x, gu, gate_up=True))
    assert err < TOL[dtype], err
    assert not ws.counters.any()


@pytest.mark.parametrize("config", [SPLIT, NO_SPLIT, PREQUANT], ids=["split", "nosplit", "prequant"])
def test_decode_gemm_per_channel_and_small_groups(runner, config):
    """A per-channel weight (one scale a row over all K) and a 64-column block grid (the K step
    follows the weight's group)."""
    g = case_generator("decode groups", config)
    dev = runner.device
    x = rows_of_every_size(7, 256, g, torch.float32)
    w = channel_weight(80, 256, g, "cpu")
    got = runner(DECODE, x.to(dev), on(dev, w, nan_pad=False), config=config)
    assert relative_error(got, fp8_decode_reference(x, w)) < TOL[torch.float32]
    w64 = block_weight([96], 256, (64, 64), g, "cpu")
    got = runner(DECODE, x.to(dev), on(dev, w64), config=config)
    assert relative_error(got, fp8_decode_reference(x, w64)) < TOL[torch.float32]


@pytest.mark.parametrize("m", [3, 32])
def test_x_quantized_before_the_gemm_gives_the_same_bits(runner, m):
    """prequant only moves x's quantization out of the K loop into its own kernel: the same FP8
    values and scales reach the same dots, so the outputs are equal to the bit (bias, gate/up)."""
    import dataclasses
    g = case_generator("decode prequant", m)
    dev = runner.device
    k = 400
    w = block_weight([48, 24, 24], k, (32, 128), g, "cpu", shard_start=8)
    x = rows_of_every_size(m, k, g, torch.float32).to(DTYPES[0]).to(dev)
    bias = torch.randn(w.q.shape[0], generator=g).to(DTYPES[0]).to(dev)
    for gate_up in (False, True):
        wt = block_weight([40, 40], k, (32, 128), g, "cpu") if gate_up else w
        b = None if gate_up else bias
        outs = [runner(DECODE, x, on(dev, wt), b, config=dataclasses.replace(SPLIT, prequant=pre), gate_up=gate_up)
                for pre in (False, True)]
        assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("m,config", [(3, SPLIT), (32, PREQUANT), (5, NO_SPLIT)])
def test_x_quantized_by_the_norm_gives_the_same_bits(runner, m, config):
    """The RMSNorm before qkv and gate/up can hand the GEMM its output already in FP8
    (kernels.rms_norm.rms_norm_fp8_rows): the GEMM then reads those bytes and scales instead of
    quantizing x itself, and its output is equal to the bit, gate/up included."""
    import dataclasses
    g = case_generator("decode norm rows", m)
    dev = runner.device
    k = 400
    x = rows_of_every_size(m, k, g, torch.float32).to(torch.bfloat16).to(dev)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(dev)
    residual = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    normed, _, rows = runner("kernels.rms_norm:rms_norm_fp8_rows", x, norm_w, 1e-6, residual, 128)
    for gate_up in (False, True):
        wt = block_weight([40, 40] if gate_up else [48, 24, 24], k, (32, 128), g, "cpu")
        plain = runner(DECODE, normed, on(dev, wt), config=dataclasses.replace(config, prequant=False), gate_up=gate_up)
        fed = runner(DECODE, normed, on(dev, wt), config=config, gate_up=gate_up, x_fp8=rows)
        assert torch.equal(plain, fed), (plain - fed).abs().max()


def test_rows_of_another_group_or_shape_are_refused(runner):
    from kernels.fp8 import FP8_DTYPE, Fp8Rows
    g = case_generator("decode rows refused")
    w = on(runner.device, block_weight([64], 256, (32, 128), g, "cpu"))
    x = torch.randn(4, 256, generator=g).to(runner.device)
    q = torch.zeros(4, 256, dtype=FP8_DTYPE, device=runner.device)
    for rows, says in ((Fp8Rows(q, torch.ones(4, 4, device=runner.device), 64), "groups of 128"),
                       (Fp8Rows(q[:3], torch.ones(3, 2, device=runner.device), 128), r"rows \[4, 256\]"),
                       (Fp8Rows(q, torch.ones(4, 3, device=runner.device), 128), "scales")):
        with pytest.raises(Exception, match=says):
            runner(DECODE, x, w, config=NO_SPLIT, x_fp8=rows)


def test_a_split_the_workspace_cannot_hold_is_narrowed(runner):
    """Four splits of a 29 x 96 output need 11136 partial floats: a workspace of 6000 gets two,
    and the result is the same product."""
    g = case_generator("decode narrow")
    dev = runner.device
    w = block_weight([96], 512, (32, 128), g, "cpu")
    x = torch.randn(29, 512, generator=g)
    small = SmallBatchWorkspace.create(dev, max_partial_floats=6000, max_tiles=8)
    config = Fp8DecodeConfig(block_n=32, num_warps=4, num_stages=1, split_k=4)
    got = runner(DECODE, x.to(dev), on(dev, w), config=config, workspace=small)
    assert relative_error(got, fp8_decode_reference(x, w)) < TOL[torch.float32]
    assert not small.counters.any()


def test_bad_input_is_refused():
    from kernels.fp8_decode_gemm import fp8_decode_linear

    g = case_generator("decode bad")
    w = channel_weight(8, 32, g, "cpu")
    with pytest.raises(ValueError, match="1..32 rows"):
        fp8_decode_linear(torch.randn(33, 32), w)
    with pytest.raises(ValueError, match="1..32 rows"):
        fp8_decode_linear(torch.randn(2, 24), w)  # K not a multiple of 16
