"""Triton kernels behind kernels.fused_moe (imported lazily: needs triton).

- _select_experts_kernel: per token, softmax over E logits, k rounds of argmax, optional
  renormalisation (triton_moe_topk.py).
- _align_kernel: one program sorts the T*k (token, slot) pairs by local expert without
  atomics (a pair's place = its expert's padded start + how many earlier pairs share the
  expert), pads every expert's run to block_m, and labels each row block with its expert.
  Used up to ALIGN_SINGLE_PROGRAM_MAX pairs (every decode batch); beyond it the same layout
  comes from a few torch ops (prefill, where launches do not matter).
- _moe_gemm_kernel: a grouped GEMM over those row blocks. GATE_UP: each program computes
  the gate and the up tile of its expert and writes silu(g)*u. MUL_W: the down projection,
  scaled by the pair's routing weight. Programs past the padded count return at once.
- _moe_sum_kernel: each token's k rows summed in slot order (slots whose expert lives on
  another rank skipped): deterministic, unlike atomics."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_moe_config import MoEConfig, get_config
from kernels.triton_moe_topk import TL_DTYPES, softmax_topk

ALIGN_SINGLE_PROGRAM_MAX = 4096


@triton.jit
def _select_experts_kernel(logits, weights_out, ids_out, num_experts, stride_l,
                           TOP_K: tl.constexpr, TOP_KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
                           ROUND_TO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EP)
    ok = cols < num_experts
    x = tl.load(logits + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    softmax_topk(x, ok, cols, weights_out, ids_out, row, TOP_K, TOP_KP, RENORM, ROUND_TO)


def launch_select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, round_to=None):
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _select_experts_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                                     TOP_KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(e),
                                     RENORM=renormalize, ROUND_TO=TL_DTYPES.get(round_to),
                                     num_warps=4 if e > 256 else 1)
    return weights, ids


@triton.jit(do_not_specialize=["num_pairs", "sorted_len", "num_blocks"])
def _align_kernel(ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, cursor_ptr,
                  num_pairs, sorted_len, num_blocks,
                  EP: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, HAS_MAP: tl.constexpr):
    ex = tl.arange(0, EP)
    # 1. pairs per local expert
    counts = tl.zeros([EP], tl.int32)
    for c in range(0, num_pairs, CH):
        offs = c + tl.arange(0, CH)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        if HAS_MAP:
            e = tl.load(emap_ptr + e, mask=e >= 0, other=-1)
        counts += tl.sum((e[None, :] == ex[:, None]).to(tl.int32), axis=1)
    # 2. padded runs: expert e owns rows [pend[e] - padded[e], pend[e])
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    tl.store(cursor_ptr + ex, pend - padded)
    for c in range(0, sorted_len, CH):  # padding rows point past the last pair
        offs = c + tl.arange(0, CH)
        tl.store(sorted_ptr + offs, tl.zeros([CH], tl.int32) + num_pairs, mask=offs < sorted_len)
    for c in range(0, num_blocks, CH):  # a block's expert: how many runs end at or before it
        b = c + tl.arange(0, CH)
        start = b * BM
        owner = tl.sum((pend[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(start < total, owner, -1), mask=b < num_blocks)
    tl.debug_barrier()
    # 3. each pair's row: its expert's cursor + earlier pairs of the expert in this chunk
    earlier = tl.arange(0, CH)[None, :] < tl.arange(0, CH)[:, None]
    for c in range(0, num_pairs, CH):
        offs = c + tl.arange(0, CH)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        if HAS_MAP:
            e = tl.load(emap_ptr + e, mask=e >= 0, other=-1)
        valid = e >= 0
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + e, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        added = tl.sum((e[None, :] == ex[:, None]).to(tl.int32), axis=1)
        tl.debug_barrier()
        now = tl.load(cursor_ptr + ex)
        tl.debug_barrier()
        tl.store(cursor_ptr + ex, now + added)
        tl.debug_barrier()


def _align(topk_ids, expert_map, num_local: int, block_m: int):
    """(sorted pair indices [blocks*block_m], block experts [blocks], padded count [1])."""
    dev = topk_ids.device
    pairs = topk_ids.numel()
    padded_max = pairs + num_local * (block_m - 1)
    if pairs < num_local:
        padded_max = min(padded_max, pairs * block_m)
    blocks = triton.cdiv(padded_max, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    flat = topk_ids.reshape(-1)
    if pairs <= ALIGN_SINGLE_PROGRAM_MAX:
        ep = triton.next_power_of_2(num_local)
        cursor = torch.empty(ep, dtype=torch.int32, device=dev)
        ch = max(16, min(128, 4096 // ep))
        _align_kernel[(1,)](flat, expert_map if expert_map is not None else flat, sorted_ids, block_expert, num_post,
                            cursor, pairs, blocks * block_m, blocks, EP=ep, BM=block_m, CH=ch,
                            HAS_MAP=expert_map is not None, num_warps=4)
        return sorted_ids, block_expert, num_post
    # many pairs (prefill): the same layout from sort / scatter / searchsorted, no host sync
    e = flat.long()
    if expert_map is not None:
        e = expert_map.long()[e]
    e = torch.where(e >= 0, e, num_local)  # off-rank pairs sort last and are dropped
    order = torch.argsort(e, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev).scatter_add_(0, e, torch.ones_like(e))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    cstart = torch.cumsum(counts, 0) - counts
    se = e[order]
    valid = se < num_local
    sc = se.clamp(max=num_local - 1)
    dest = pstart[sc] + torch.arange(pairs, device=dev) - cstart[sc]
    dest = torch.where(valid, dest, blocks * block_m)  # a trash slot past the end
    full = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int32, device=dev)
    full.scatter_(0, dest, order.to(torch.int32))
    sorted_ids.copy_(full[:-1])
    starts = torch.arange(blocks, device=dev) * block_m
    total = pend[-1]
    owner = torch.searchsorted(pend, starts, right=True)
    block_expert.copy_(torch.where(starts < total, owner, -1).to(torch.int32))
    num_post.copy_(total.reshape(1).to(torch.int32))
    return sorted_ids, block_expert, num_post


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr, num_post_ptr,
                     N, K, num_pairs, num_blocks, stride_am, stride_we, stride_wn, stride_cm,
                     TOP_K: tl.constexpr, GATE_UP: tl.constexpr, MUL_W: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
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
    a_row = pair // TOP_K if A_BY_TOKEN else pair
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        k_ok = offs_k < K - kk * BK
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:  # the up rows sit I = N rows below the gate rows
            wu = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
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


@triton.jit
def _moe_sum_kernel(rows_ptr, ids_ptr, emap_ptr, out_ptr, H, stride_out,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_MAP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        if HAS_MAP:
            e = tl.load(emap_ptr + e)
        if e >= 0:
            acc += tl.load(rows_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _gemm(a, w, c, topk_weights, sorted_ids, block_expert, num_post, n_out: int, k_in: int, top_k: int,
          tile, gate_up: bool, mul_w: bool, a_by_token: bool):
    blocks = block_expert.numel()
    grid = (blocks * triton.cdiv(n_out, tile.block_n),)
    _moe_gemm_kernel[grid](
        a, w, c, topk_weights, sorted_ids, block_expert, num_post, n_out, k_in, topk_weights.numel(), blocks,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        TOP_K=top_k, GATE_UP=gate_up, MUL_W=mul_w, A_BY_TOKEN=a_by_token,
        BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def launch_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, out, config: MoEConfig | None):
    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None:
        dtype_name = str(x.dtype).removeprefix("torch.")
        config = get_config(t, expert_map.numel() if expert_map is not None else num_local, h, inter, top_k,
                            dtype_name)
    ids = topk_ids if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() else \
        topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.contiguous()
    sorted_ids, block_expert, num_post = _align(ids, expert_map, num_local, config.block_m)
    inter_rows = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter_rows, weights, sorted_ids, block_expert, num_post, inter, h, top_k, config.gate_up,
          gate_up=True, mul_w=False, a_by_token=True)
    expert_rows = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    _gemm(inter_rows, w2, expert_rows, weights, sorted_ids, block_expert, num_post, h, inter, top_k, config.down,
          gate_up=False, mul_w=True, a_by_token=False)
    block = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block))](
        expert_rows, ids, expert_map if expert_map is not None else ids, out, h, out.stride(0),
        TOP_K=top_k, BLOCK=block, HAS_MAP=expert_map is not None, num_warps=4)
    return out
