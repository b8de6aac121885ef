"""Triton kernel behind kernels.rms_norm (imported lazily: needs triton)."""

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2
from kernels.pdl import launch_options, pdl_for
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def launch_rms_norm(x, weight, eps, residual=None, out=None, residual_out=None, pdl=None):
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
    if n_rows:
        block = next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out2, h2, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl is not None,
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl),
        )
    return out if residual is None else (out, h)
