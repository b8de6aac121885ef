"""Triton kernel behind kernels.small_batch_linear (imported lazily: needs triton).

Grid (tiles, split_k): program (t, s) reads weight rows [t*BLOCK_N, (t+1)*BLOCK_N) (and
the matching up rows for the fused gate/up kernel) over the s-th K range, once, in
[BLOCK_N, BLOCK_K] tiles of whole 16-byte vectors; x's [M, BLOCK_K] slice comes from
L2. Rows past N are clamped to N-1 (loads stay unmasked and vectorised; their outputs
are never stored). fp32 accumulation.

Split-K reduction, deterministic and CUDA-graph safe: each program stores its fp32
partial, then (after a CTA barrier) one thread bumps the tile's arrival counter with an
acq_rel atomic (CUTLASS's split-K semaphore pattern); the program that arrives last
sums the partials in split order 0..S-1 (same bits whatever the arrival order), runs
the epilogue, and resets the counter to 0, so every launch leaves the counters as it
found them. No host sync, no data-dependent allocation.

FP8 weights (kernels/fp8_linear.py): the tile is widened in registers and each row's partial
product scaled by its block scale. With cfg.widen_f16 (tensor-core path, 16-bit x) the tile is
widened to fp16, one hardware conversion per two weights (e4m3 -> bf16 takes two or three), and
x's tile goes to fp16 too, each row scaled by a power of two so its largest value sits in
[2^13, 2^14): exact for every element above 2^-30 of that largest one, so the product is still
W8A16's (kernels/triton_f16_rows.py). x's scaling costs a row reduction every K step: it paid only on the fused gate/up,
where one x tile serves two weight tiles (kernels/small_batch_linear_config.py).
A K tile may span several scale groups: it is read as SUB_K-column sub-tiles (SUB_K divides the group, so a sub-tile row has one scale), all
issued in one unrolled step, so an FP8 tile keeps as many bytes in flight as a 16-bit one of
half its width: one byte a weight from memory, the rest as for 16-bit weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import Pdl, launch_options, pdl_for, pdl_late
from kernels.small_batch_linear_config import SmallBatchConfig

from kernels.triton_f16_rows import rows_to_f16
from kernels.triton_pdl import pdl_enter_late, pdl_release, prefetch_l2


@triton.jit
def _zeros(BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # M == 1: element-wise partial sums in the weight tile's layout, reduced over K after the loop
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _mac(acc, wt, xt, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += wt[BLOCK_N, BLOCK_K] x xt[BLOCK_M, BLOCK_K]^T in fp32: a tensor-core dot, or
    (BLOCK_M == 1) CUDA-core multiply-adds with no cross-thread work inside the loop."""
    if USE_DOT:
        acc = tl.dot(wt, tl.trans(xt), acc, input_precision=DOT_PRECISION)
    else:
        acc += wt.to(tl.float32) * xt.to(tl.float32)
    return acc


@triton.jit
def _mac_fp8(acc, wt, xt, w_scale, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """_mac for an FP8 weight tile whose rows' scales (one K group: BLOCK_K divides it) are
    w_scale [BLOCK_N]: the tile is widened to x's dtype (exact), the products scaled per row."""
    if USE_DOT:
        acc += tl.dot(wt.to(xt.dtype), tl.trans(xt), input_precision=DOT_PRECISION) * w_scale[:, None]
    else:
        acc += wt.to(tl.float32) * w_scale[:, None] * xt.to(tl.float32)
    return acc


@triton.jit
def _mac_fp8_f16(acc, wt, x16, w_scale, x_down):
    """_mac_fp8 on the tensor cores in fp16: the e4m3 tile widened to fp16 (exact, one
    conversion per two weights), x16/x_down from rows_to_f16."""
    d = tl.dot(wt.to(tl.float16), tl.trans(x16))
    return acc + d * w_scale[:, None] * x_down[None, :]


@triton.jit
def _finish(acc, USE_DOT: tl.constexpr):
    """[BLOCK_N, BLOCK_M] sums."""
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)[:, None]
    return acc


@triton.jit
def _epilogue(acc, acc_up, bias, out, rn, rm, n_ok, m_ok, stride_om,
              HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if GATE_UP:  # silu(gate) * up, as kernels.silu_and_mul
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    ptrs = out + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _small_batch_linear_kernel(
    x, w, bias, out, partials, counters, w_scale, scale_row,
    M, N, K, up_elems, k_blocks_per_split, split_k, group_k,
    stride_xm, stride_wn, stride_om, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE_ELEMS: tl.constexpr, FP8: tl.constexpr,
    WIDEN_F16: tl.constexpr, PDL_LATE: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, SUB_K)
    k_start = split * k_blocks_per_split * BLOCK_K
    k_end = tl.minimum(k_start + k_blocks_per_split * BLOCK_K, K)
    if PDL:
        # The weights are constant: pull this program's first tiles into L2 while the
        # previous kernel (norm, attention, another GEMV's tail) is still running.
        lines = tl.arange(0, BLOCK_K // LINE_ELEMS) * LINE_ELEMS
        for i in tl.static_range(PREFETCH):
            kk = tl.minimum(k_start + i * BLOCK_K + lines, k_end - 1)
            line_ptrs = w + rows[:, None] * stride_wn + kk[None, :]
            prefetch_l2(line_ptrs)
            if GATE_UP:
                prefetch_l2(line_ptrs + up_elems)
        pdl_enter_late(PDL, PDL_LATE)

    w_ptrs = w + rows[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + up_elems  # the up half's rows: N rows further down
    x_ptrs = x + rm[:, None] * stride_xm + rk[None, :]
    if FP8:  # each row's scales: its scale row (the up rows' are N rows further down)
        s_ptrs = w_scale + tl.load(scale_row + rows).to(tl.int64) * stride_ws
        if GATE_UP:
            su_ptrs = w_scale + tl.load(scale_row + rows + N).to(tl.int64) * stride_ws
    acc = _zeros(BLOCK_N, BLOCK_M, SUB_K, USE_DOT)
    acc_up = _zeros(BLOCK_N, BLOCK_M, SUB_K, USE_DOT)
    for k0 in range(k_start, k_end, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):  # one sub-tile for 16-bit weights
            ks = k0 + sub * SUB_K
            # a sub-tile past K (last tile) is masked to zeros, but its scale column would lie
            # past the row: read the row's last one, since 0 * a stray NaN is NaN
            sk = tl.minimum(ks, K - 1) // group_k
            if EVEN_K:
                xt = tl.load(x_ptrs + ks, mask=m_ok[:, None], other=0.0)
                wt = tl.load(w_ptrs + ks)
            else:
                k_ok = (ks + rk) < K
                xt = tl.load(x_ptrs + ks, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs + ks, mask=k_ok[None, :], other=0.0)
            if WIDEN_F16:
                x16, x_down = rows_to_f16(xt)
                acc = _mac_fp8_f16(acc, wt, x16, tl.load(s_ptrs + sk), x_down)
            elif FP8:
                acc = _mac_fp8(acc, wt, xt, tl.load(s_ptrs + sk), USE_DOT, DOT_PRECISION)
            else:
                acc = _mac(acc, wt, xt, USE_DOT, DOT_PRECISION)
            if GATE_UP:
                if EVEN_K:
                    ut = tl.load(u_ptrs + ks)
                else:
                    ut = tl.load(u_ptrs + ks, mask=((ks + rk) < K)[None, :], other=0.0)
                if WIDEN_F16:
                    acc_up = _mac_fp8_f16(acc_up, ut, x16, tl.load(su_ptrs + sk), x_down)
                elif FP8:
                    acc_up = _mac_fp8(acc_up, ut, xt, tl.load(su_ptrs + sk), USE_DOT, DOT_PRECISION)
                else:
                    acc_up = _mac(acc_up, ut, xt, USE_DOT, DOT_PRECISION)
    pdl_release(PDL, PDL_LATE)
    acc = _finish(acc, USE_DOT)
    acc_up = _finish(acc_up, USE_DOT)

    split_k_finish(acc, acc_up, bias, out, partials, counters, tile, split, split_k, M, N, rn, rm, n_ok, m_ok,
                   stride_om, HAS_BIAS, GATE_UP, SPLIT)


@triton.jit
def split_k_finish(acc, acc_up, bias, out, partials, counters, tile, split, split_k, M, N, rn, rm, n_ok, m_ok,
                   stride_om, HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, SPLIT: tl.constexpr):
    """The epilogue of a program's [BLOCK_N, BLOCK_M] sums (acc_up: the up half's, GATE_UP);
    under split-K (SPLIT), the deterministic reduction of the module note first."""
    if SPLIT:
        num_acc = 2 if GATE_UP else 1
        mask = n_ok[:, None] & m_ok[None, :]
        p_ptrs = partials + (split * num_acc * M + rm[None, :]) * N + rn[:, None]
        tl.store(p_ptrs, acc, mask=mask)
        if GATE_UP:
            tl.store(p_ptrs + M * N, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            total_up = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, split_k):  # fixed order: the same bits every run
                q_ptrs = partials + (s * num_acc * M + rm[None, :]) * N + rn[:, None]
                total += tl.load(q_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                if GATE_UP:
                    total_up += tl.load(q_ptrs + M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, total_up, bias, out, rn, rm, n_ok, m_ok, stride_om, HAS_BIAS, GATE_UP)
            tl.store(counters + tile, 0)  # ready for the next launch (graph replays)
    else:
        _epilogue(acc, acc_up, bias, out, rn, rm, n_ok, m_ok, stride_om, HAS_BIAS, GATE_UP)


def fp8_sub_k(block_k: int, group_k: int) -> int:
    """The widest power-of-two sub-tile of a K tile that sits inside one scale group."""
    sub = block_k
    while group_k % sub:
        sub //= 2
    return sub


def _block_m(m: int, use_dot: bool) -> int:
    block = 1
    while block < m:
        block *= 2
    return max(block, 16) if use_dot else block  # tl.dot needs >= 16 rows; the CUDA-core path runs M == 1 only


def launch_small_batch_linear(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor,
                              cfg: SmallBatchConfig, workspace, gate_up: bool, pdl: Pdl | None = None,
                              fp8=None) -> torch.Tensor:
    """x [M, K], w [N_w, K] (row stride free, last dim contiguous), out [M, N_out] with a
    contiguous last dim; N_out = N_w, or N_w // 2 for gate_up. workspace: a
    SmallBatchWorkspace or None (then split-K allocates its buffers per call).
    fp8: a kernels.fp8.Fp8Weight whose q is w (a sub-tile of cfg.block_k must divide its
    group_k: fp8_sub_k). cfg.widen_f16: FP8 weights times 16-bit x on the tensor cores widen
    both to fp16 (the module note)."""
    m, k = x.shape
    n = out.shape[1]
    pdl = pdl_for(pdl, m)
    use_dot = cfg.use_dot or m > 1  # the CUDA-core path is written for one row
    tiles = triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, cfg.block_k)
    split_k = min(cfg.split_k, k_blocks)
    k_blocks_per_split = triton.cdiv(k_blocks, split_k)
    split_k = triton.cdiv(k_blocks, k_blocks_per_split)  # no split left without K
    num_acc = 2 if gate_up else 1
    if split_k > 1:
        need = split_k * num_acc * m * n
        if workspace is None:
            partials = torch.empty(need, dtype=torch.float32, device=x.device)
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        else:
            partials, counters = workspace.buffers(need, tiles)
    else:
        partials, counters = out, out  # never touched without split-K
    ws, srow = (fp8.scale, fp8.scale_row) if fp8 is not None else (out, out)
    _small_batch_linear_kernel[(tiles, split_k)](
        x, w, bias if bias is not None else out, out, partials, counters, ws, srow,
        m, n, k, n * w.stride(0) if gate_up else 0, k_blocks_per_split, split_k,
        min(fp8.group_k, 1 << 30) if fp8 is not None else 1,
        x.stride(0), w.stride(0), out.stride(0), ws.stride(0) if fp8 is not None else 0,
        BLOCK_M=_block_m(m, use_dot), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SUB_K=fp8_sub_k(cfg.block_k, fp8.group_k) if fp8 is not None else cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, GATE_UP=gate_up, SPLIT=split_k > 1,
        USE_DOT=use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl is not None, PREFETCH=min(pdl.prefetch_k_blocks, k_blocks_per_split) if pdl else 0,
        LINE_ELEMS=min(cfg.block_k, 128 // w.element_size()), FP8=fp8 is not None,
        WIDEN_F16=cfg.widen_f16 and fp8 is not None and use_dot and x.dtype in (torch.bfloat16, torch.float16),
        PDL_LATE=pdl_late(pdl, m),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return out
