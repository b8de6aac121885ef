"""The cuBLAS block-scaled route of fp8_linear (kernels/fp8_cublas.py): which weights it takes
(only the plain 128x128 block map, which is what the library's scales can say), that it stays
off without a GPU, and on a GPU that the library's product is the W8A8 reference's and that
fp8_linear's long prefills give the same numbers by either route."""

import pytest
import torch

from kernels.fp8 import PER_CHANNEL_GROUP_K, Fp8Weight
from kernels.fp8_cublas import cublas_route, weight_fits
from shared.engine.quantization.fp8_params import Fp8Layout, RowSlice, ScaleGrid
from tests.helpers.kernel_dtypes import CUDA, case_generator


def layout_weight(parts, k, device="cpu", per_channel=False) -> Fp8Weight:
    """A weight laid out as the engine lays a stacked / sharded one (Fp8Layout)."""
    grid = ScaleGrid.of(None if per_channel else (128, 128))
    layout = Fp8Layout(tuple(RowSlice(start, rows) for start, rows in parts), 0, k, 0, grid)
    g = case_generator("cublas layout", parts, k)
    q = torch.randn(layout.rows, k, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(layout.scale_rows, layout.scale_cols, generator=g) + 0.5
    return Fp8Weight(q.to(device), scale.to(device), layout.scale_row_map().to(device), grid.group_k,
                     layout.uniform_tile_n)


def test_only_the_plain_block_map_is_taken():
    assert weight_fits(layout_weight([(0, 4096), (0, 1024), (0, 1024)], 4096))  # q/k/v, whole blocks
    assert weight_fits(layout_weight([(0, 12288)], 4096))
    # a stacked part starting inside a block keeps its own scale rows: not i // 128
    assert not weight_fits(layout_weight([(0, 4096), (0, 64), (0, 64)], 4096))
    # a tensor-parallel shard starting inside a block
    assert not weight_fits(layout_weight([(64, 1024)], 4096))
    assert not weight_fits(layout_weight([(0, 1024)], 4096, per_channel=True))
    assert not weight_fits(layout_weight([(0, 1024)], 4224))  # 33 scale columns: not whole 16-byte rows
    w = layout_weight([(0, 1024)], 4096)
    assert not weight_fits(Fp8Weight(w.q, w.scale, w.scale_row, PER_CHANNEL_GROUP_K, w.tile_n))


def test_the_route_stays_off_without_a_gpu():
    w = layout_weight([(0, 1024)], 4096)
    assert not cublas_route(torch.randn(4096, 4096), w)


def test_the_route_takes_bf16_only():
    """The probe checks bf16 products; fp16 and fp32 activations keep the Triton GEMM."""
    w = layout_weight([(0, 1024)], 4096)
    for dtype in (torch.float16, torch.float32):
        assert not cublas_route(torch.randn(256, 4096).to(dtype), w)


@pytest.mark.skipif(not CUDA, reason="cuBLAS needs a GPU")
@pytest.mark.parametrize("m", [128, 1000, 4099])  # 4099: rows padded to the library's alignment
def test_cublas_route_matches_the_triton_gemm(m):
    from kernels.fp8_linear import per_token_group_quant, w8a8_gemm, w8a8_gemm_reference
    from kernels.fp8_cublas import cublas_fp8_linear

    w = layout_weight([(0, 1024), (0, 256), (0, 256)], 2048, "cuda")
    x = torch.randn(m, 2048, generator=case_generator("cublas", m)).to("cuda", torch.bfloat16)
    hopper_api = torch.cuda.get_device_capability() == (9, 0) and hasattr(torch.nn.functional, "scaled_mm")
    if not cublas_route(x, w):
        assert not hopper_api, "the probe refused cuBLAS on a Hopper GPU whose torch has scaled_mm"
        pytest.skip("this GPU or torch build has no block-scaled cuBLAS GEMM")
    got = cublas_fp8_linear(x, w)
    xq, xs = per_token_group_quant(x)
    ref = w8a8_gemm_reference(xq, xs, w)
    triton_out = w8a8_gemm(xq, xs, w)
    assert got.shape == (m, 1536) and got.is_contiguous()
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    assert rel(got, ref) < 1e-2
    assert rel(got, triton_out) < 1e-2
