"""Triton kernel behind kernels.fp8_decode_gemm (imported lazily: needs triton).

Grid (tiles, split_k): program (t, s) multiplies weight rows [t*BLOCK_N, (t+1)*BLOCK_N) (and the
matching up rows for gate/up) by x's M <= 64 rows over the s-th K range, in K steps of one
activation group (BLOCK_K = 128). Each step quantizes x's [BLOCK_M, BLOCK_K] slice to FP8 per
row (scale = max|x| / 448, the prefill's per-token-group recipe, kernels/triton_fp8_gemm.py),
takes an FP8 tensor-core dot with the weight tile as the MMA's M side (BLOCK_N = 64 or 128
weight rows against x's rows padded to 16: "swap AB"), and promotes it with the weight's block
scale and x's group scale. The weight tiles come in through TMA and go to the tensor cores as
bytes: nothing is widened, which is what bounds the W8A16 GEMV past one row. Split-K
and the epilogue (bias, SwiGLU, the deterministic reduction) are the small-batch kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import Pdl, launch_options, pdl_for, pdl_late, pdl_wait_first
from kernels.triton_fp8 import FP8_MAX, fp8_grid
from kernels.triton_pdl import pdl_enter, pdl_enter_late, pdl_release, prefetch_l2
from kernels.triton_small_batch_linear import split_k_finish


# The x quantization kernel launched with PDL where its GEMM is (the bench's switch: before, it
# launched plainly, so it and the GEMM after it each waited for the kernel before to end)
QUANTIZE_PDL = True


@triton.jit
def _quantize_rows(x_ptrs, m_ok, k_ok, eps):
    """x's [BLOCK_M, BLOCK_K] slice as FP8 and each row's scale (zero rows: eps / 448): the values
    are multiplied by the scale's reciprocal, each row's two divisions IEEE-rounded, so the
    result is fp8_decode_reference's to the bit. Dividing every value instead costs: IEEE
    division per value is a long instruction sequence in the K loop (and a zero dividend takes
    its slow path: a one-row batch's tile is 15 rows of zeros), a fast division is off by an ulp
    at the exact ties bf16 inputs hit often."""
    xf = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), 1), eps)
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    return fp8_grid(xf * inv[:, None]).to(tl.float8e4nv), tl.math.div_rn(amax, FP8_MAX)


@triton.jit
def _quantize_x_kernel(x, xq, xs, M, K, eps, stride_xm, stride_qm, stride_sm,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       WAIT_FIRST: tl.constexpr):
    """Program g: every row's group g of x, quantized as the GEMM's K step does it (_quantize_rows),
    into xq (FP8) and xs (a scale a row and group). Under PDL (a short kernel: it waits, then
    signals, kernels/pdl.py wait_first_from_rows) the GEMM after it is scheduled while it runs."""
    pdl_enter(PDL, WAIT_FIRST)
    g = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = g * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok, k_ok = rm < M, rk < K
    q, s = _quantize_rows(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], m_ok, k_ok, eps)
    tl.store(xq + rm[:, None].to(tl.int64) * stride_qm + rk[None, :], q, mask=m_ok[:, None] & k_ok[None, :])
    tl.store(xs + rm.to(tl.int64) * stride_sm + g, s, mask=m_ok)


@triton.jit
def _fp8_decode_gemm_kernel(
    x, xs, w, w_desc, w_scale, scale_row, bias, out, partials, counters,
    M, N, K, up_rows, steps_per_split, split_k, group_k, eps,
    stride_xm, stride_xsm, stride_wn, stride_ws, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    PREQUANT: tl.constexpr, PDL_LATE: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_n = tile * BLOCK_N
    rn = off_n + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_start = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    if PDL:
        # the weights are constant: this program's first lines go to L2 while the kernel
        # before is still running (kernels/pdl.py)
        for i in tl.static_range(PREFETCH):
            line_ptrs = w + rows * stride_wn + tl.minimum(k_start + i * BLOCK_K, K - 1)
            prefetch_l2(line_ptrs)
            if GATE_UP:
                prefetch_l2(line_ptrs + up_rows * stride_wn)
        pdl_enter_late(PDL, PDL_LATE)

    s_ptrs = w_scale + tl.load(scale_row + rows).to(tl.int64) * stride_ws
    if GATE_UP:
        su_ptrs = w_scale + tl.load(scale_row + rows + up_rows).to(tl.int64) * stride_ws
    x_ptrs = x + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREQUANT:  # x is already FP8 (_quantize_x_kernel), xs its scales
            xq = tl.load(x_ptrs + k0, mask=m_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
            sx = tl.load(xs + rm * stride_xsm + k0 // BLOCK_K, mask=m_ok, other=0.0)
        else:
            xq, sx = _quantize_rows(x_ptrs + k0, m_ok, (k0 + rk) < K, eps)
        sk = k0 // group_k  # BLOCK_K divides group_k: one weight scale a row this step
        d = tl.dot(w_desc.load([off_n, k0]), tl.trans(xq))  # rows past the weight read as zeros
        acc += d * (tl.load(s_ptrs + sk)[:, None] * sx[None, :])
        if GATE_UP:
            d_up = tl.dot(w_desc.load([up_rows + off_n, k0]), tl.trans(xq))
            acc_up += d_up * (tl.load(su_ptrs + sk)[:, None] * sx[None, :])
    pdl_release(PDL, PDL_LATE)

    split_k_finish(acc, acc_up, bias, out, partials, counters, tile, split, split_k, M, N, rn, rm, n_ok, m_ok,
                   stride_om, HAS_BIAS, GATE_UP, SPLIT)


def launch_fp8_decode_gemm(x: torch.Tensor, w, bias, out: torch.Tensor, cfg, workspace, gate_up: bool,
                           pdl: Pdl | None, group: int, eps: float, x_fp8=None) -> torch.Tensor:
    """x [M, K] (last dim contiguous), w a kernels.fp8.Fp8Weight [N_w, K], out [M, N_out] with a
    contiguous last dim (N_out = N_w, or N_w // 2 for gate_up); cfg a Fp8DecodeConfig whose
    split_k the wrapper has fitted to the workspace; x_fp8 a kernels.fp8.Fp8Rows of x (with
    cfg.prequant) or None."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = out.shape[1]
    pdl = pdl_for(pdl, m)
    tiles = triton.cdiv(n, cfg.block_n)
    steps = triton.cdiv(k, group)
    per_split = triton.cdiv(steps, min(cfg.split_k, steps))
    split_k = triton.cdiv(steps, per_split)  # no split left without K
    if split_k > 1:
        need = split_k * (2 if gate_up else 1) * m * n
        if workspace is None:
            partials = torch.empty(need, dtype=torch.float32, device=x.device)
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        else:
            partials, counters = workspace.buffers(need, tiles)
    else:
        partials, counters = out, out  # never touched without split-K
    q = w.q
    block_m = max(16, triton.next_power_of_2(m))
    xs = out  # never read without prequant
    if x_fp8 is not None:  # quantized by the kernel that made x (kernels/rms_norm.py)
        x, xs = x_fp8.q, x_fp8.scales
    elif cfg.prequant:  # x quantized once here, not by every program at every K step
        xq = torch.empty(m, k, dtype=q.dtype, device=x.device)
        xs = torch.empty(m, steps, dtype=torch.float32, device=x.device)
        _quantize_x_kernel[(steps, triton.cdiv(m, block_m))](
            x, xq, xs, m, k, eps, x.stride(0), xq.stride(0), xs.stride(0), BLOCK_M=block_m, BLOCK_K=group,
            PDL=pdl is not None and QUANTIZE_PDL, WAIT_FIRST=pdl_wait_first(pdl, m), num_warps=4, **launch_options(pdl if QUANTIZE_PDL else None))
        x = xq
    _fp8_decode_gemm_kernel[(tiles, split_k)](
        x, xs, q, TensorDescriptor.from_tensor(q, [cfg.block_n, group]), w.scale, w.scale_row,
        bias if bias is not None else out, out, partials, counters,
        m, n, k, n if gate_up else 0, per_split, split_k, min(w.group_k, 1 << 30), eps,
        x.stride(0), xs.stride(0), q.stride(0), w.scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=group,
        HAS_BIAS=bias is not None, GATE_UP=gate_up, SPLIT=split_k > 1,
        PDL=pdl is not None, PREFETCH=min(pdl.prefetch_k_blocks, per_split) if pdl else 0,
        PREQUANT=cfg.prequant, PDL_LATE=pdl_late(pdl, m),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return out
