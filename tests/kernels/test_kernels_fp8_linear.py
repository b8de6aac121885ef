"""FP8 linears (kernels/fp8_linear.py, triton_fp8_gemm.py, the small-batch kernel's FP8 path)
against their torch references on fresh random inputs: the fp8 rounding bit for bit (ties,
subnormals, saturation), per-token-group activation quantization bit for bit, the W8A8 GEMM
and the W8A16 small-batch kernel with block scales (partial edge blocks, stacked parts whose
scale rows restart, a shard starting inside a block), per-channel scales, bias, gate/up+SwiGLU.

On the CPU these run in Triton's interpreter, which executes FP8 loads, stores and dots (the
dots exactly, in wider precision): what it cannot show is the FP8 tensor-core numerics and
speed of a real GPU, which `duet bench --sections fp8` measures."""

from dataclasses import replace

import pytest
import torch

from kernels.fp8 import (FP8_DTYPE, PER_CHANNEL_GROUP_K, Fp8Weight, block_scale_rows, dequantize_block,
                         per_token_group_quant_reference, quantize_block, quantize_channel)
from kernels.fp8_linear import (fp8_linear_reference, gate_up_silu_fp8_reference, gemm_config,
                                small_batch_fp8_reference, w8a8_gemm_reference)
from kernels.small_batch_linear import SmallBatchWorkspace
from kernels.small_batch_linear_config import SmallBatchConfig
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import CUDA, case_generator

QUANT = "kernels.fp8_linear:per_token_group_quant"
GEMM = "kernels.fp8_linear:w8a8_gemm"
SMALL = "kernels.fp8_linear:small_batch_fp8_linear"
LINEAR = "kernels.fp8_linear:fp8_linear"
GRID = "tests.helpers.fp8_grid_kernel:fp8_grid_of"
# interpreter: fp32 (exact dots); natively bf16 too (one rounding of the output)
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# FP8 tensor-core dots (W8A8) add in reduced precision inside each 128-column step on a GPU
GEMM_TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.bfloat16: 1e-2}


def block_weight(n_parts, k, block, g, device, shard_start: int = 0) -> Fp8Weight:
    """Stacked parts of the given row counts, each quantized on its own block grid (as
    checkpoint tensors are), the way the engine stacks q/k/v: scale rows restart per part.
    shard_start: the rows kept of the first part start there (a TP shard inside a block)."""
    qs, scales, rows, off = [], [], [], 0
    for i, n in enumerate(n_parts):
        full_rows = n + (shard_start if i == 0 else 0)
        w = torch.randn(full_rows, k, generator=g) * (0.5 + i)
        q, s = quantize_block(w, block)
        start = shard_start if i == 0 else 0
        first_block = start // block[0]
        last_block = (start + n - 1) // block[0]
        qs.append(q[start:start + n])
        scales.append(s[first_block:last_block + 1])
        rows.append((torch.arange(start, start + n) // block[0]) - first_block + off)
        off += last_block - first_block + 1
    return Fp8Weight(torch.cat(qs).to(device), torch.cat(scales).to(device),
                     torch.cat(rows).to(torch.int32).to(device), block[1])


def nan_padded_columns(scale: torch.Tensor) -> torch.Tensor:
    """The same scales as a view whose rows are followed by NaN columns (row stride wider)."""
    padded = torch.full((scale.shape[0], scale.shape[1] + 2), float("nan"))
    padded[:, :scale.shape[1]] = scale
    return padded[:, :scale.shape[1]]


def channel_weight(n, k, g, device) -> Fp8Weight:
    q, s = quantize_channel(torch.randn(n, k, generator=g))
    return Fp8Weight(q.to(device), s.to(device), torch.arange(n, dtype=torch.int32, device=device),
                     PER_CHANNEL_GROUP_K)


def test_fp8_rounding_matches_torch_bit_for_bit(runner):
    vals = torch.arange(0, 126, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = (vals[:-1] + vals[1:]) / 2  # every tie between neighbours
    g = case_generator("grid")
    x = torch.cat([torch.linspace(-470, 470, 3000), torch.randn(1000, generator=g) * 1e-3, mids, -mids,
                   torch.tensor([0.0, -0.0, 2 ** -10, 448.0, 464.0, -500.0])])
    got = runner(GRID, x.to(runner.device))
    assert torch.equal(got.cpu().view(torch.uint8), x.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))


@pytest.mark.parametrize("k,group", [(320, 128), (576, 128), (96, 32)])
def test_group_quant_is_the_reference_bit_for_bit(runner, k, group):
    g = case_generator("quant", k, group)
    x = torch.randn(7, k, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0  # an all-zero row: tiny scale, zeros
    x[5, :group] *= 1e4  # one loud group
    q, s = runner(QUANT, x.to(runner.device), group)
    rq, rs = per_token_group_quant_reference(x, group)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    # the same scales stored column by column, as cuBLAS's block-scaled GEMM reads them
    q, s = runner(QUANT, x.to(runner.device), group, m_major=True)
    assert s.stride() == (1, 7) and torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["stacked_partial_blocks", "shard_inside_block", "per_channel", "tile_uniform"])
@pytest.mark.parametrize("tma,pairs", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("k", [200, 256, 384])  # a partial group; whole groups (no K masks); 3 groups (a lone last pair)
def test_w8a8_gemm_matches_reference(runner, dtype, case, tma, pairs, k):
    g = case_generator("gemm", dtype, case, k)
    m = 37
    tile_n = 0
    if case == "per_channel":
        w = channel_weight(90, k, g, "cpu")
    elif case == "tile_uniform":  # parts on 32-row boundaries: each 32-row N tile has one scale row
        w, tile_n = block_weight([64, 32, 32], k, (32, 128), g, "cpu"), 32
    else:
        w = block_weight([72, 40, 40], k, (32, 128), g, "cpu", shard_start=20 if case == "shard_inside_block" else 0)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    bias = torch.randn(w.q.shape[0], generator=g).to(dtype)
    xq, xs = per_token_group_quant_reference(x)
    dev = runner.device
    wd = Fp8Weight(w.q.to(dev), w.scale.to(dev), w.scale_row.to(dev), w.group_k, tile_n)
    config = replace(gemm_config(m, w.q.shape[0], 128, torch.device(dev)), tma=tma, k_pairs=pairs)
    if tile_n:
        config = replace(config, block_n=tile_n)
    out = fill_nan_(torch.empty(m, w.q.shape[0], dtype=dtype, device=dev))
    runner(GEMM, xq.to(dev), xs.to(dev), wd, bias.to(dev), dtype, out=out, config=config)
    assert relative_error(out, w8a8_gemm_reference(xq, xs, w, bias, dtype)) < GEMM_TOL[dtype]


def test_block_dequantization_of_partial_edge_blocks():
    g = case_generator("dequant")
    w = torch.randn(200, 130, generator=g)
    q, s = quantize_block(w, (128, 128))
    assert s.shape == (2, 2) and q.dtype == FP8_DTYPE
    d = dequantize_block(q, s, (128, 128))
    assert relative_error(d, w) < 0.05  # e4m3: 3 mantissa bits
    # the view the engine holds gives the same numbers
    assert torch.equal(Fp8Weight(q, s, block_scale_rows(200, 128), 128).dequantize(), d)
    with pytest.raises(ValueError, match="block scales"):
        dequantize_block(q, s[:1], (128, 128))


SPLIT = SmallBatchConfig(block_n=16, block_k=64, split_k=3)
NO_SPLIT = SmallBatchConfig(block_n=32, block_k=128, split_k=1)
FMA = SmallBatchConfig(block_n=16, block_k=512, split_k=2, use_dot=False)  # 128-column sub-tiles, the last past K = 384


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 29])  # 29: FP8 weights run here up to 32 rows (a 32-row tile)
@pytest.mark.parametrize("config", [SPLIT, NO_SPLIT, FMA], ids=["split", "nosplit", "fma"])
def test_small_batch_fp8_matches_reference(runner, dtype, m, config):
    g = case_generator("small", dtype, m, config)
    k = 384
    w = block_weight([48, 24, 24], k, (32, 128), g, "cpu", shard_start=8)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(w.q.shape[0], generator=g).to(dtype)
    dev = runner.device
    # NaN just past each scale row: a tile reading a scale column past K poisons the output
    wd = Fp8Weight(w.q.to(dev), nan_padded_columns(w.scale).to(dev), w.scale_row.to(dev), w.group_k)
    ws = SmallBatchWorkspace.create(dev, max_partial_floats=1 << 14, max_tiles=64)
    out = fill_nan_(torch.empty(m, w.q.shape[0], dtype=dtype, device=dev))
    runner(SMALL, x.to(dev), wd, bias.to(dev), out=out, config=config, workspace=ws)
    assert relative_error(out, small_batch_fp8_reference(x, w, bias)) < TOL[dtype]
    assert not ws.counters.any()
    # gate/up + SwiGLU: the stacked gate and up parts keep their own scale rows
    gu = block_weight([40, 40], k, (32, 128), g, "cpu")
    gud = Fp8Weight(gu.q.to(dev), nan_padded_columns(gu.scale).to(dev), gu.scale_row.to(dev), gu.group_k)
    got = runner(SMALL, x.to(dev), gud, config=config, gate_up=True)
    assert relative_error(got, gate_up_silu_fp8_reference(x, gu)) < TOL[dtype]


@pytest.mark.parametrize("config", [replace(SPLIT, widen_f16=True), replace(NO_SPLIT, widen_f16=True)],
                         ids=["split", "nosplit"])
def test_small_batch_fp8_with_bf16_rows_of_any_magnitude(runner, config):
    """widen_f16: 16-bit x on the tensor-core path runs in fp16 (one conversion per two weights): each row
    is scaled by a power of two first, so rows far past fp16's 65504 and rows of 1e-6 come out as
    the float64 product rounded to bf16, per row, not inf or zeros."""
    g = case_generator("f16 widening", config)
    k = 384
    w = block_weight([48, 24, 24], k, (32, 128), g, "cpu", shard_start=8)
    x = torch.randn(5, k, generator=g)
    x[0] *= 3e5  # every product past fp16's range before scaling
    x[1] *= 1e-6
    x[2, 7] = 4e6  # one outlier column among ordinary values
    x[3] = 0.0
    x = x.to(torch.bfloat16)
    dev = runner.device
    wd = Fp8Weight(w.q.to(dev), w.scale.to(dev), w.scale_row.to(dev), w.group_k)
    got = runner(SMALL, x.to(dev), wd, config=config).float().cpu()
    # the fused gate/up (where the engine's table takes it) shares the scaled x tile
    gu = block_weight([40, 40], k, (32, 128), g, "cpu")
    gud = Fp8Weight(gu.q.to(dev), gu.scale.to(dev), gu.scale_row.to(dev), gu.group_k)
    got_gu = runner(SMALL, x.to(dev), gud, config=config, gate_up=True).float().cpu()
    want_gu = gate_up_silu_fp8_reference(x, gu).float()
    for row in (0, 1, 2, 4):
        assert relative_error(got_gu[row], want_gu[row]) < 6e-3, row
    want = small_batch_fp8_reference(x, w).float()
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # bf16's own rounding of the output (up to 2^-8: the interpreter stores bf16 by truncation);
    # unscaled, row 0 is inf and row 1 keeps a few bits (fp16 subnormals): errors of 1e-2 and more
    for row in (0, 1, 2, 4):
        assert relative_error(got[row], want[row]) < 6e-3, row


@pytest.mark.parametrize("m", [1, 2, 29, 40])
def test_fp8_linear_routes_and_matches_its_reference(runner, m):
    """Up to 32 rows: the decode GEMM (activations quantized inside it, kernels/fp8_decode_gemm.py;
    at one row because the small-batch sweep never tuned this shape); more: activations quantized
    in one launch, then the GEMM. The reference takes the same route."""
    g = case_generator("route", m)
    w = channel_weight(64, 256, g, "cpu")
    x = torch.randn(m, 256, generator=g)
    dev = runner.device
    wd = Fp8Weight(w.q.to(dev), w.scale.to(dev), w.scale_row.to(dev), w.group_k)
    got = runner(LINEAR, x.to(dev), wd)
    assert relative_error(got, fp8_linear_reference(x, w)) < GEMM_TOL[torch.float32]
    # and it stays near the unquantized product (FP8 weights and activations)
    assert relative_error(got, x @ w.dequantize().T) < 0.08
    # the fused gate/up + SwiGLU at decode sizes takes the same kernel
    if m <= 32:
        from kernels.fp8_decode_gemm import fp8_decode_reference
        gu = block_weight([40, 40], 256, (32, 128), g, "cpu")
        gud = Fp8Weight(gu.q.to(dev), gu.scale.to(dev), gu.scale_row.to(dev), gu.group_k)
        got = runner("kernels.fp8_linear:fp8_gate_up_silu", x.to(dev), gud)
        assert relative_error(got, fp8_decode_reference(x, gu, gate_up=True)) < GEMM_TOL[torch.float32]
        # --fp8-decode-gemm off (the layers' workspace says so): the W8A16 small-batch kernel
        ws = replace(SmallBatchWorkspace.create(dev, max_partial_floats=1 << 16, max_tiles=64), fp8_decode_gemm=False)
        got = runner(LINEAR, x.to(dev), wd, workspace=ws)
        assert relative_error(got, small_batch_fp8_reference(x, w)) < 1e-5
        got = runner("kernels.fp8_linear:fp8_gate_up_silu", x.to(dev), gud, workspace=ws)
        assert relative_error(got, gate_up_silu_fp8_reference(x, gu)) < 1e-5


def test_one_row_of_a_tuned_shape_takes_the_small_batch_kernel(runner):
    """A shape the small-batch FP8 sweep tuned (Qwen3-30B-A3B's router, 128 x 2048) keeps one row
    on that kernel (W8A16: no activation rounding, its tiles as fast as the decode GEMM's);
    two rows of it take the decode GEMM."""
    g = case_generator("tuned one row")
    w = block_weight([128], 2048, (128, 128), g, "cpu")
    dev = runner.device
    wd = Fp8Weight(w.q.to(dev), w.scale.to(dev), w.scale_row.to(dev), w.group_k)
    x = torch.randn(2, 2048, generator=g)
    assert relative_error(runner(LINEAR, x[:1].to(dev), wd), small_batch_fp8_reference(x[:1], w)) < 1e-5
    from kernels.fp8_decode_gemm import fp8_decode_reference
    assert relative_error(runner(LINEAR, x.to(dev), wd), fp8_decode_reference(x, w)) < GEMM_TOL[torch.float32]
    assert relative_error(fp8_linear_reference(x[:1], w), small_batch_fp8_reference(x[:1], w)) == 0


def test_bad_input_is_refused():
    from kernels.fp8_linear import fp8_linear, small_batch_fp8_linear, w8a8_gemm

    g = case_generator("bad")
    w = channel_weight(8, 32, g, "cpu")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fp8_linear(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.randn(2, 32), Fp8Weight(w.q.float(), w.scale, w.scale_row, w.group_k))
    with pytest.raises(ValueError, match="1..32 rows"):
        small_batch_fp8_linear(torch.randn(33, 32), w)
    with pytest.raises(ValueError, match="activation scales"):
        w8a8_gemm(w.q[:2], torch.ones(3, 1), w)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [4, 29, 40, 200])
def test_fp8_linear_replays_in_a_cuda_graph(m):
    """Both routes capture (no host sync, scratch from a workspace or the graph's pool) and a
    replay with new inputs in the same buffer gives the eager result."""
    from kernels.fp8_linear import fp8_linear

    g = case_generator("graph", m)
    w = block_weight([3072, 1024, 1024], 4096, (128, 128), g, "cuda")
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    ws = SmallBatchWorkspace.create("cuda")
    fp8_linear(x, w, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, workspace=ws)
    x.copy_(torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, w, workspace=ws))
    assert relative_error(out, fp8_linear_reference(x, w)) < 1e-2
