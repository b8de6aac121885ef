"""Triton kernel behind kernels.fp8_moe's grouped GEMMs (imported lazily: needs triton).

_moe_gemm_fp8_kernel is triton_fused_moe._moe_gemm_kernel with FP8 operands: the rows are
the same expert-sorted, block-padded (token, slot) pairs (triton_fused_moe._align), A is
the FP8 activations with per-row-and-group scales (quantized per token for gate/up, per pair
for down), B an expert's FP8 weight with block (or per-channel) scales, and every K step of
one activation group is an FP8 tensor-core dot scaled by both and added in fp32 (as
triton_fp8_gemm.py). The epilogues (SwiGLU of rounded gate/up, the routing weight) and the
top-k sum (triton_fused_moe._moe_sum_kernel) are those of the 16-bit path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_fused_moe import _align, _moe_sum_kernel


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, srow_ptr, c_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr,
                         num_post_ptr, N, K, num_pairs, num_blocks, group_k,
                         stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsr, stride_cm,
                         TOP_K: tl.constexpr, GATE_UP: tl.constexpr, MUL_W: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BM >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    a_row = tl.where(row_ok, pair // TOP_K if A_BY_TOKEN else pair, 0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    cols = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + a_row * stride_asm
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    ws_base = ws_ptr + expert * stride_wse
    ws_ptrs = ws_base + tl.load(srow_ptr + cols).to(tl.int64) * stride_wsr
    if GATE_UP:  # the up rows sit I = N rows below the gate rows, with their own scale rows
        wu_ptrs = w_ptrs + N * stride_wn
        wsu_ptrs = ws_base + tl.load(srow_ptr + cols + N).to(tl.int64) * stride_wsr
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        k_ok = offs_k < K - kk * BK
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kk, mask=row_ok, other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        w_s = tl.load(ws_ptrs + (kk * BK) // group_k)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        if GATE_UP:
            wu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
            wu_s = tl.load(wsu_ptrs + (kk * BK) // group_k)
            acc_up += tl.dot(a, wu) * a_s[:, None] * wu_s[None, :]
            wu_ptrs += BK
        a_ptrs += BK
        w_ptrs += BK
    dt = c_ptr.dtype.element_ty
    if GATE_UP:  # gate and up rounded as the unfused matmul would leave them, then SwiGLU
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        res = g / (1.0 + tl.exp(-g)) * u
    else:
        res = acc
    if MUL_W:
        wt = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
        res = res.to(dt).to(tl.float32) * wt[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, res.to(dt), mask=row_ok[:, None] & n_ok[None, :])


def _gemm(a, a_s, w, c, topk_weights, sorted_ids, block_expert, num_post, n_out: int, k_in: int, top_k: int,
          tile, gate_up: bool, mul_w: bool, a_by_token: bool):
    blocks = block_expert.numel()
    grid = (blocks * triton.cdiv(n_out, tile.block_n),)
    _moe_gemm_fp8_kernel[grid](
        a, a_s, w.q, w.scale, w.scale_row, c, topk_weights, sorted_ids, block_expert, num_post,
        n_out, k_in, topk_weights.numel(), blocks, min(w.group_k, 1 << 30),
        a.stride(0), a_s.stride(0), w.q.stride(0), w.q.stride(1), w.scale.stride(0), w.scale.stride(1), c.stride(0),
        TOP_K=top_k, GATE_UP=gate_up, MUL_W=mul_w, A_BY_TOKEN=a_by_token,
        BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def launch_fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, expert_map, out, config, group: int):
    """x [T, H] (16-bit or fp32); w13, w2: kernels.fp8.Fp8Weight of [E, 2I, H] and [E, H, I]."""
    from kernels.fp8_linear import per_token_group_quant

    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_local, two_i, _ = w13.q.shape
    inter = two_i // 2
    ids = topk_ids if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() else \
        topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.contiguous()
    sorted_ids, block_expert, num_post = _align(ids, expert_map, num_local, config.block_m)
    xq, xs = per_token_group_quant(x if x.stride(1) == 1 else x.contiguous(), group)
    inter_rows = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    _gemm(xq, xs, w13, inter_rows, weights, sorted_ids, block_expert, num_post, inter, h, top_k, config.gate_up,
          gate_up=True, mul_w=False, a_by_token=True)
    iq, is_ = per_token_group_quant(inter_rows, group)
    expert_rows = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    _gemm(iq, is_, w2, expert_rows, weights, sorted_ids, block_expert, num_post, h, inter, top_k, config.down,
          gate_up=False, mul_w=True, a_by_token=False)
    block = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block))](
        expert_rows, ids, expert_map if expert_map is not None else ids, out, h, out.stride(0),
        TOP_K=top_k, BLOCK=block, HAS_MAP=expert_map is not None, num_warps=4)
    return out
