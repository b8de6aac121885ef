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
