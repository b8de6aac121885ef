"""Triton kernel behind kernels.rms_norm (imported lazily: needs triton)."""

import torch
import triton
import triton.language as tl

from kernels.paged_kv import next_power_of_2
from kernels.pdl import launch_options, pdl_for, pdl_wait_first
from kernels.triton_fp8 import FP8_MAX, fp8_grid
from kernels.triton_pdl import pdl_enter


TILE = 128  # the row is held as [BLOCK // TILE, TILE] (see the kernel's note)


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, h_out, q_out, q_scales, eps, q_eps,
    stride_x, stride_r, stride_out, stride_h, stride_q, stride_qs, n_cols,
    HAS_RESIDUAL: tl.constexpr, TILES: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr,
    GROUP: tl.constexpr, WAIT_FIRST: tl.constexpr,
):
    """One row per program, held as [TILES, TILE] from its load on, with or without FP8 rows
    (GROUP > 0: the output also written as the decode GEMM quantizes x, triton_fp8_decode_gemm.
    _quantize_rows: the rounded output times 448 / max|group| per group). Both launches share
    this code, so the normed values are the same bits either way (a separate kernel's other
    reduction order changed greedy tokens), and the groups are the tile's rows without a layout
    change (a 1-D row reshaped into groups goes through shared memory, several times the launch)."""
    pdl_enter(PDL, WAIT_FIRST)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]
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
    if GROUP > 0:
        yf = y.to(tl.float32)  # columns past n_cols are zeros and move no maximum
        if GROUP != TILE:  # narrower groups (weights of 32/64-column blocks): the rounded values regrouped
            yf = tl.reshape(yf, [TILES * TILE // GROUP, GROUP])
            gcols = tl.reshape(cols, [TILES * TILE // GROUP, GROUP])
        else:
            gcols = cols
        amax = tl.maximum(tl.max(tl.abs(yf), 1), q_eps)
        inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
        tl.store(q_out + row * stride_q + gcols, fp8_grid(yf * inv[:, None]).to(tl.float8e4nv), mask=gcols < n_cols)
        g = tl.arange(0, TILES * TILE // GROUP)
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
    q, qs, group, q_eps = quant if quant is not None else (out2, out2, 0, 0.0)  # unused when GROUP is 0
    if group > TILE or TILE % max(group, 1):
        raise ValueError(f"FP8 rows are quantized by groups dividing {TILE} columns, not {group}")
    n_rows = x2.shape[0]
    pdl = pdl_for(pdl, n_rows)
    if n_rows:
        block = max(next_power_of_2(n_cols), TILE)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out2, h2, q, qs, eps, q_eps,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), q.stride(0), qs.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, TILES=block // TILE, TILE=TILE, PDL=pdl is not None, GROUP=group,
            WAIT_FIRST=pdl_wait_first(pdl, n_rows),
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl),
        )
    return out if residual is None else (out, h)
