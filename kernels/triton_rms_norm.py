"""Triton kernel behind kernels.rms_norm (imported lazily: needs triton)."""

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2
from kernels.pdl import launch_options, pdl_for
from kernels.triton_fp8 import FP8_MAX, fp8_grid
from kernels.triton_pdl import pdl_enter


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, h_out, eps,
    stride_x, stride_r, stride_out, stride_h, n_cols,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    xv = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        rv = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        hv = (xv.to(tl.float32) + rv.to(tl.float32)).to(h_out.dtype.element_ty)
        tl.store(h_out + row * stride_h + cols, hv, mask=ok)
        hf = hv.to(tl.float32)
    else:
        hf = xv.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    wv = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, (hf * inv_rms * wv).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_fp8_rows_kernel(
    x, residual, weight, out, h_out, q_out, q_scales, eps, q_eps,
    stride_x, stride_r, stride_out, stride_h, stride_q, stride_qs, n_cols,
    HAS_RESIDUAL: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
):
    """_rms_norm_kernel's row as [GROUPS, GROUP] tiles, also written in FP8 the way the decode
    GEMM quantizes x (triton_fp8_decode_gemm._quantize_rows): the rounded output times
    448 / max|group| per group. The row is 2-D from its load on: a 1-D row reshaped into groups
    made the kernel 3-4x slower on an H100 (a layout change through shared memory, byte stores)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < n_cols
    xv = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        rv = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        hv = (xv.to(tl.float32) + rv.to(tl.float32)).to(h_out.dtype.element_ty)
        tl.store(h_out + row * stride_h + cols, hv, mask=ok)
        hf = hv.to(tl.float32)
    else:
        hf = xv.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(tl.sum(hf * hf, 1), 0) / n_cols + eps)
    wv = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    y = (hf * inv_rms * wv).to(out.dtype.element_ty)
    tl.store(out + row * stride_out + cols, y, mask=ok)
    yf = y.to(tl.float32)  # columns past n_cols are zeros and move no maximum
    amax = tl.maximum(tl.max(tl.abs(yf), 1), q_eps)
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    tl.store(q_out + row * stride_q + cols, fp8_grid(yf * inv[:, None]).to(tl.float8e4nv), mask=ok)
    g = tl.arange(0, GROUPS)
    tl.store(q_scales + row * stride_qs + g, tl.math.div_rn(amax, FP8_MAX), mask=g * GROUP < n_cols)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def launch_rms_norm(x, weight, eps, residual=None, out=None, residual_out=None, pdl=None, quant=None):
    """quant: (q [rows, n_cols] float8_e4m3fn, scales [rows, groups] float32, group, eps) to
    also write the output quantized per row per group (kernels.rms_norm.rms_norm_fp8_rows)."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
        h2 = h.view(-1, n_cols)
    else:
        r2, h2 = x2, out2  # unused when HAS_RESIDUAL is False
    n_rows = x2.shape[0]
    pdl = pdl_for(pdl, n_rows)
    if n_rows and quant is not None:
        q, qs, group, q_eps = quant
        groups = next_power_of_2(-(-n_cols // group))
        _rms_norm_fp8_rows_kernel[(n_rows,)](
            x2, r2, weight, out2, h2, q, qs, eps, q_eps,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), q.stride(0), qs.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, GROUPS=groups, GROUP=group, PDL=pdl is not None,
            num_warps=min(16, max(1, groups * group // 256)), **launch_options(pdl),
        )
    elif n_rows:
        block = next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out2, h2, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl is not None,
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl),
        )
    return out if residual is None else (out, h)
