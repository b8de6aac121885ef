"""Triton kernel behind kernels.silu_and_mul (imported lazily: needs triton)."""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out + row * stride_out + cols, act.to(out.dtype.element_ty), mask=ok)


def launch_silu_and_mul(x: torch.Tensor, out=None) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] and inter:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, _BLOCK))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=_BLOCK, num_warps=4,
        )
    return out
