"""Block-scaled FP8 GEMM through cuBLAS: torch's scaled_mm with 1x128 activation scales and
128x128 weight scales (cuBLASLt >= 12.9 on Hopper), DeepSeek-V3's recipe as the library runs it.

Where it applies, fp8_linear sends the W8A8 products of MIN_ROWS rows or more (prefills, large
decode batches) here instead of the Triton W8A8 GEMM (kernels/triton_fp8_gemm.py), as vLLM sends
them to CUTLASS's block-scaled kernel: the library's kernel overlaps each K step's scaling with the
next step's MMAs (warp-specialised consumers), which a Triton kernel without warp specialisation
cannot: at prefill sizes it runs near the FP8 peak where Triton's stays near half of it, and in
CUDA graphs it is ahead from 128 rows and level at 64 (docs/performance/fp8.md). The Triton GEMM stays the
route everywhere else: fewer rows, fp16 or fp32 activations (the probe checks bf16), weights whose
scale rows are not the plain 128-row block map (a stacked part or a tensor-parallel shard starting
inside a block, per-channel scales) or whose shape the layout check refuses, torch builds or GPUs
without the API, and where the probe finds the library's product wrong.

Layouts the library reads: the weight [N, K] (K contiguous) is the column-major [K, N] operand
as it is; its scales [ceil(N/128), ceil(K/128)] transposed (a view); the activation scales
[M, ceil(K/128)] stored M-major, in buffers padded to ROW_ALIGN rows (cublas_fp8_linear).
"""
from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, Fp8Weight

BLOCK = 128
# rows from which the route is taken: in CUDA graphs (decode batches) the library is only level
# with the Triton GEMM at 64 rows and ahead on every linear from 128
MIN_ROWS = 128


def weight_fits(w: Fp8Weight) -> bool:
    """The weight's scales are the plain 128x128 block map cuBLAS reads: 128-column groups,
    every aligned 128-row run on one scale row and one scale row per run (so row i -> i // 128),
    float32 scale rows of whole 16-byte vectors (the library's leading-dimension rule)."""
    if w.q.dim() != 2 or w.group_k != BLOCK or w.tile_n < BLOCK:
        return False
    n, k = w.q.shape
    kb = -(-k // BLOCK)
    return (k % BLOCK == 0 and n % 16 == 0 and w.scale.shape == (-(-n // BLOCK), kb) and w.scale.stride() == (kb, 1)
            and kb % 4 == 0 and w.q.stride() == (k, 1))


def _scaled_mm(xq: torch.Tensor, xs_mmajor: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] fp8, xs_mmajor [M, K/128] with stride (1, M'), w's q [N, K] -> [M, N]."""
    import torch.nn.functional as F

    b, b_scale = w.q.t(), w.scale.t()
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType
        return F.scaled_mm(xq, b, xs_mmajor, st.BlockWise1x128, b_scale, st.BlockWise128x128, output_dtype=out_dtype)
    # older torch: _scaled_mm infers block-wise scaling from the scale shapes
    return torch._scaled_mm(xq, b, scale_a=xs_mmajor, scale_b=b_scale, out_dtype=out_dtype)


def cublas_w8a8(xq: torch.Tensor, xs_mmajor: torch.Tensor, w: Fp8Weight, bias=None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Quantized activations (rows a multiple of ROW_ALIGN, scales M-major) times the weight."""
    y = _scaled_mm(xq, xs_mmajor, w, out_dtype)
    return y if bias is None else y.add_(bias)


# cuBLAS refused 4099 rows and takes them padded to 16 (our reading: the M-major fp32 scales'
# leading dimension, M, must be a 16-byte multiple, M % 4; 16 rows covers that)
ROW_ALIGN = 16


def cublas_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias=None) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype: x quantized per token per 128 columns into buffers padded
    to ROW_ALIGN rows (the padding zeros), the library's GEMM, the real rows returned."""
    from kernels.fp8 import ACT_EPS
    from kernels.triton_fp8_gemm import launch_group_quant

    m, k = x.shape
    rows = -(-m // ROW_ALIGN) * ROW_ALIGN
    xq = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty(k // BLOCK, rows, dtype=torch.float32, device=x.device).t()
    if rows > m:
        xq[m:].zero_()
        xs[m:].fill_(1.0)
    launch_group_quant(x, xq[:m], xs[:m], BLOCK, ACT_EPS)
    return cublas_w8a8(xq, xs, w, bias, x.dtype)[:m]


def _probe(device_index: int) -> bool:
    """One small product through the library against the dequantized float64 one: False where
    torch lacks the API, cuBLAS refuses it (not Hopper, cuBLASLt < 12.9), or the numbers are off."""
    dev = torch.device("cuda", device_index)
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        m, n, k = 37, 256, 512  # rows not a multiple of ROW_ALIGN: prefill lengths are anything
        from kernels.fp8 import block_scale_rows, dequantize_activations, per_token_group_quant_reference

        q = (torch.randn(n, k, device=dev, generator=g) * 4).to(FP8_DTYPE)
        scale = torch.rand(n // BLOCK, k // BLOCK, device=dev, generator=g) + 0.5
        w = Fp8Weight(q, scale, block_scale_rows(n, BLOCK).to(dev), BLOCK, BLOCK)
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        got = cublas_fp8_linear(x, w).double()
        xq, xs = per_token_group_quant_reference(x)
        want = dequantize_activations(xq, xs).double() @ w.dequantize(torch.float64).T
        return bool(((got - want).norm() / want.norm()).item() < 1e-2)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def available(device: torch.device) -> bool:
    """The library passed its probe on this device (run once per device; never inside a
    CUDA-graph capture, where it answers False until a later eager call has probed)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[index] = _probe(index)
    return _PROBED[index]


def cublas_route(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Send this product to cuBLAS: a bf16 CUDA x (what the probe checks) of >= MIN_ROWS rows, a
    weight in the plain block layout, and a library that passed its probe (`available`)."""
    if x.dtype != torch.bfloat16 or x.shape[0] < MIN_ROWS or not weight_fits(w):
        return False
    return available(x.device)


_PROBED: dict[int, bool] = {}  # device index -> the probe's answer (a property of the GPU and the torch build)
