"""RMSNorm, optionally fused with the residual add that precedes it.

With residual: h = x + residual (rounded to x's dtype, as the unfused model
does), returns (rms_norm(h) * weight, h). Math in float32, output in x's dtype.
"""

from typing import Optional

import torch


def _check(x, weight, residual):
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError("residual must have x's shape")


def rms_norm_reference(x, weight, eps: float, residual: Optional[torch.Tensor] = None):
    _check(x, weight, residual)
    acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
    h = x
    if residual is not None:
        h = (x.to(acc) + residual.to(acc)).to(x.dtype)
    hf = h.to(acc)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight.to(acc)).to(x.dtype)
    return out if residual is None else (out, h)


def rms_norm(x, weight, eps: float, residual: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None, pdl=None):
    """Triton: one program per row. out / residual_out: optional contiguous
    preallocated results (residual_out may be residual itself: in-place update).
    pdl: a kernels.pdl.Pdl to launch with programmatic dependent launch (Hopper+)."""
    _check(x, weight, residual)
    from kernels.triton_rms_norm import launch_rms_norm

    return launch_rms_norm(x, weight, eps, residual, out, residual_out, pdl)


def rms_norm_fp8_rows_reference(x, weight, eps: float, residual: Optional[torch.Tensor] = None, group: int = 128):
    """rms_norm_reference, plus its output quantized as the decode GEMM quantizes x
    (quantize_rows_reference): (out, h or None, Fp8Rows)."""
    from kernels.fp8 import FP8_DTYPE, Fp8Rows
    from kernels.fp8_decode_gemm import quantize_rows_reference

    res = rms_norm_reference(x, weight, eps, residual)
    out, h = res if residual is not None else (res, None)
    q, s = quantize_rows_reference(out.reshape(-1, out.shape[-1]), group)
    return out, h, Fp8Rows(q.to(FP8_DTYPE), s, group)


def rms_norm_fp8_rows(x, weight, eps: float, residual: Optional[torch.Tensor] = None, group: int = 128,
                      residual_out: Optional[torch.Tensor] = None, pdl=None):
    """Triton: rms_norm, whose kernel also writes its output quantized per row per group of
    `group` columns the way the decode GEMM quantizes x (kernels/fp8.py Fp8Rows): the FP8
    linear after the norm then skips that step (and at 17..32 rows, a launch). Returns
    (out, h or None, Fp8Rows); out and h as rms_norm's."""
    _check(x, weight, residual)
    from kernels.fp8 import ACT_EPS, FP8_DTYPE, Fp8Rows
    from kernels.triton_rms_norm import launch_rms_norm

    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(rows, -(-k // group), dtype=torch.float32, device=x.device)
    res = launch_rms_norm(x, weight, eps, residual, None, residual_out, pdl, quant=(q, s, group, ACT_EPS))
    out, h = res if residual is not None else (res, None)
    return out, h, Fp8Rows(q, s, group)
