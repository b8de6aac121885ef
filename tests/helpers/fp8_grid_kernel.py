"""A Triton kernel that exposes kernels/triton_fp8.py's rounding, for the kernel tests (run
through tests/helpers/kernel_runner.py; imports triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_fp8 import fp8_grid


@triton.jit
def _grid_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(o_ptr + offs, fp8_grid(tl.load(x_ptr + offs, mask=ok, other=0.0)).to(o_ptr.dtype.element_ty), mask=ok)


def fp8_grid_of(x: torch.Tensor) -> torch.Tensor:
    """x (float32, 1-d) rounded by triton_fp8.fp8_grid and stored as float8_e4m3fn."""
    out = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=x.device)
    _grid_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out
