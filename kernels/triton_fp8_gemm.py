"""Triton kernels behind kernels.fp8_linear (imported lazily: needs triton).

- _group_quant_kernel, grid (M/ROWS, groups): ROWS rows of one group of GROUP columns -> each
  row's scale (max|x| / 448) and FP8 values (x / scale on the fp8 grid, triton_fp8.fp8_grid).
  Several rows a program: one row a program made a prefill's quantization millions of
  one-warp programs.
- _w8a8_gemm_kernel, grid (M/BM * N/BN), grouped along M for L2 reuse: FP8 x FP8 tensor-core
  dots over K steps of one activation group (BK = group); each step's fp32 dot is scaled by
  its activation scales (per row) and weight scales and added to an fp32 accumulator.
  Scaling per step is the "promotion" DeepSeek-V3 describes: no FP8 MMA accumulates over more
  than one group. Tiles come in through TMA (host tensor descriptors; out-of-bounds rows and
  columns read as zeros) or, with TMA off, through pointer loads. UNIFORM_BS: the whole
  N tile shares one weight scale row (block scales whose blocks the tile does not cross), so
  a step's scale is one value per row (a_s * b_s) and the promotion is one FMA an element
  instead of two multiplies and an add. PAIRS: two K steps an iteration, both dots issued
  before the promotions. Bias and the cast to the output dtype in the epilogue. No host sync
  (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_fp8 import FP8_MAX, fp8_grid


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, stride_sg, eps,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    row_ok = rows < M
    ok = row_ok[:, None] & ((tl.arange(0, BLOCK) < GROUP) & (cols < K))[None, :]
    r = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), eps), FP8_MAX)
    q = fp8_grid(tl.math.div_rn(x, scale[:, None]))
    tl.store(q_ptr + r * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + g * stride_sg, scale, mask=row_ok)


def launch_group_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int, eps: float) -> None:
    m, k = x.shape
    if m == 0:
        return
    block = triton.next_power_of_2(group)
    groups = triton.cdiv(k, group)
    # ~4k elements a program for long inputs; fewer rows (down to one) while that leaves
    # under ~8 programs an SM (a decode batch of 32 rows of 4096 would otherwise be 32 programs)
    rows = max(1, min(triton.next_power_of_2(m), 4096 // block))
    while rows > 1 and triton.cdiv(m, rows) * groups < 1024:
        rows //= 2
    _group_quant_kernel[(triton.cdiv(m, rows), groups)](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), eps,
        GROUP=group, BLOCK=block, ROWS=rows, num_warps=4 if rows * block >= 2048 else 1)


@triton.jit
def _promote(acc, d, a_s, bs_ptrs, k_col, group_k, UNIFORM_BS: tl.constexpr):
    """acc + d scaled by this K step's activation scales (rows) and weight scales."""
    if UNIFORM_BS:
        return acc + d * (a_s * tl.load(bs_ptrs + k_col // group_k))[:, None]
    b_s = tl.load(bs_ptrs + k_col // group_k)
    return acc + d * a_s[:, None] * b_s[None, :]


@triton.jit
def _tiles(a_ptrs, b_ptrs, a_desc, b_desc, off_m, off_n, k0, K, offs_k,
           TMA: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr):
    """The [BM, BK] activation and [BK, BN] weight tiles of the K step starting at k0."""
    if TMA:
        a = a_desc.load([off_m, k0])
        b = b_desc.load([off_n, k0]).T
    elif EVEN_K:
        a = tl.load(a_ptrs + k0)
        b = tl.load(b_ptrs + k0)
    else:
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_ok[:, None], other=0.0)
    return a, b


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_kernel(a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr, srow_ptr, c_ptr, bias_ptr,
                      M, N, K, group_k,
                      stride_am, stride_asm, stride_bn, stride_bsr, stride_cm,
                      HAS_BIAS: tl.constexpr, UNIFORM_BS: tl.constexpr, TMA: tl.constexpr,
                      EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, PAIRS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: loads stay unmasked along M
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + rows * stride_asm
    if UNIFORM_BS:
        bs_ptrs = bs_ptr + tl.load(srow_ptr + pid_n * BN).to(tl.int64) * stride_bsr
    else:
        bs_ptrs = bs_ptr + tl.load(srow_ptr + cols).to(tl.int64) * stride_bsr
    steps = tl.cdiv(K, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    if PAIRS:
        # two K steps an iteration: both dots are issued before either is promoted, so the
        # tensor cores have the second while the first is scaled. A second step past K reads
        # zeros; its scales come from the row's last group (a stray NaN past the row would
        # turn 0 into NaN).
        for kp in range(0, tl.cdiv(steps, 2)):
            k0 = 2 * kp * BK
            k1 = k0 + BK
            a0, b0 = _tiles(a_ptrs, b_ptrs, a_desc, b_desc, pid_m * BM, pid_n * BN, k0, K, offs_k, TMA, False, BK)
            a1, b1 = _tiles(a_ptrs, b_ptrs, a_desc, b_desc, pid_m * BM, pid_n * BN, k1, K, offs_k, TMA, False, BK)
            d0 = tl.dot(a0, b0)
            d1 = tl.dot(a1, b1)
            last = tl.minimum(2 * kp + 1, steps - 1)
            acc = _promote(acc, d0, tl.load(as_ptrs + 2 * kp), bs_ptrs, k0, group_k, UNIFORM_BS)
            acc = _promote(acc, d1, tl.load(as_ptrs + last), bs_ptrs, last * BK, group_k, UNIFORM_BS)
    else:
        for kk in range(0, steps):
            a, b = _tiles(a_ptrs, b_ptrs, a_desc, b_desc, pid_m * BM, pid_n * BN, kk * BK, K, offs_k, TMA, EVEN_K, BK)
            acc = _promote(acc, tl.dot(a, b), tl.load(as_ptrs + kk), bs_ptrs, kk * BK, group_k, UNIFORM_BS)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides, and unit last strides."""
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def launch_w8a8_gemm(a, a_s, b, b_s, srow, group_k: int, bias, out, config, uniform_bs: bool = False) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, ceil(K/BK)] fp32, b [N, K] fp8 (K contiguous), b_s [S, KB] fp32,
    srow [N] int32, out [M, N]. uniform_bs: every N tile of config.block_n lies in one scale row."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0:
        return out
    tma = config.tma and tma_fits(a, b)
    a_desc = b_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
        b_desc = TensorDescriptor.from_tensor(b, [config.block_n, config.block_k])
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _w8a8_gemm_kernel[grid](
        a, a_desc, a_s, b, b_desc, b_s, srow, out, bias if bias is not None else out,
        m, n, k, min(group_k, 1 << 30),
        a.stride(0), a_s.stride(0), b.stride(0), b_s.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UNIFORM_BS=uniform_bs, TMA=tma, EVEN_K=k % config.block_k == 0,
        BM=config.block_m, BN=config.block_n, BK=config.block_k,
        GROUP_M=config.group_m, PAIRS=config.k_pairs, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
