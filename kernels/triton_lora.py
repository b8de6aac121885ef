"""Triton kernels behind kernels.lora (imported lazily: needs triton).

Shrink, grid (row blocks, parts x K splits, slots): program (m, p*S + k, s) takes the rows of
block m whose slot is s (none: it exits), and accumulates x[rows] @ A[s, p]^T over the k-th
split of K into a [BLOCK_M, RANK_BLOCK] float32 tile, its partial sum. A decode step has one or
two row blocks, so without splitting K a handful of programs would each walk all of K (up to
the MLP's width) one tile after another: latency, not bandwidth. Expand, grid (row blocks,
column blocks of the widest part, slots x parts): program (m, n, s*P + p) sums those rows'
partials into shrunk [BLOCK_M, R], multiplies it by B[s]'s rows of part p's n-th column block
and adds the product, times the slot's scale, into y (no atomics: the same sums every run). Ranks pad to RANK_BLOCK
(a power of two, at least 16: tl.dot's smallest tile) with masked loads. fp32 accumulation;
IEEE fp32 dots for fp32 inputs (what the token-for-token parity tests need)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(x, a, out, row_slots, T, K, R, K_SPLIT,
                        stride_xt, stride_as, stride_ap, stride_ar, stride_ok, stride_ot, stride_op,
                        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        RANK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    part = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    slot = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = rm < T
    slots = tl.load(row_slots + rm, mask=in_t, other=-1)
    mine = in_t & (slots == slot)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        rr = tl.arange(0, RANK_BLOCK)
        r_ok = rr < R
        rows = rm.to(tl.int64)
        a_base = a + slot.to(tl.int64) * stride_as + part * stride_ap
        acc = tl.zeros([BLOCK_M, RANK_BLOCK], dtype=tl.float32)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < k_hi
            xt = tl.load(x + rows[:, None] * stride_xt + rk[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_base + rr[:, None] * stride_ar + rk[None, :], mask=r_ok[:, None] & k_ok[None, :],
                         other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PRECISION)
        ptrs = out + split * stride_ok + rows[:, None] * stride_ot + part * stride_op + rr[None, :]
        tl.store(ptrs, acc, mask=mine[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(shrunk, b, y, row_slots, scales, part_starts, T, R,
                        stride_sk, stride_st, stride_sp, stride_bs, stride_bn, stride_yt,
                        SPLITS: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        RANK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2) // NUM_PARTS
    part = tl.program_id(2) % NUM_PARTS
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = rm < T
    slots = tl.load(row_slots + rm, mask=in_t, other=-1)
    mine = in_t & (slots == slot)
    lo = tl.load(part_starts + part)
    hi = tl.load(part_starts + part + 1)
    first = lo + pid_n * BLOCK_N
    if (tl.sum(mine.to(tl.int32), axis=0) > 0) & (first < hi):
        rn = first + tl.arange(0, BLOCK_N)
        n_ok = rn < hi
        rr = tl.arange(0, RANK_BLOCK)
        r_ok = rr < R
        rows = rm.to(tl.int64)
        s_ptrs = shrunk + rows[:, None] * stride_st + part * stride_sp + rr[None, :]
        s_ok = mine[:, None] & r_ok[None, :]
        st = tl.zeros([BLOCK_M, RANK_BLOCK], dtype=tl.float32)
        for k in range(SPLITS):  # the shrink's partial sums, in a fixed order
            st += tl.load(s_ptrs + k * stride_sk, mask=s_ok, other=0.0).to(tl.float32)
        bt = tl.load(b + slot.to(tl.int64) * stride_bs + rn[:, None].to(tl.int64) * stride_bn + rr[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(st.to(bt.dtype), tl.trans(bt), input_precision=DOT_PRECISION)
        scale = tl.load(scales + slot).to(tl.float32)
        ptrs = y + rows[:, None] * stride_yt + rn[None, :]
        ok = mine[:, None] & n_ok[None, :]
        old = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(ptrs, (old + acc * scale).to(y.dtype.element_ty), mask=ok)


_STARTS: dict[tuple, torch.Tensor] = {}


def _device_starts(part_starts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """part_starts on the device, made once per layout: a CUDA graph's capture meets them
    made already (its warm-up runs came first) and copies nothing from the host."""
    key = (part_starts, str(device))
    found = _STARTS.get(key)
    if found is None:
        found = _STARTS[key] = torch.tensor(part_starts, dtype=torch.int32, device=device)
    return found


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _block_m(rows: int) -> int:
    return 16 if rows <= 64 else 64


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


BLOCK_K = 64
SPLIT_K_MIN = 512  # K a split walks at least: 8 tiles


def k_splits(rows: int, k: int) -> int:
    """How many splits of K a shrink of `rows` rows takes: enough programs for a decode step's
    few row blocks to spread over the SMs; a prefill chunk's row blocks are programs enough."""
    return 1 if rows > 64 else max(1, min(32, k // SPLIT_K_MIN))


def launch_lora_shrink(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    t, k = x.shape
    slots, parts, rank, _ = a.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(3) != 1:
        raise ValueError("a's last dimension must be contiguous")
    splits = k_splits(t, k)
    k_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    out = torch.empty(splits, t, parts, rank, dtype=torch.float32, device=x.device)
    if t and slots:
        bm = _block_m(t)
        _lora_shrink_kernel[(triton.cdiv(t, bm), parts * splits, slots)](
            x, a, out, row_slots, t, k, rank, k_split, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
            out.stride(0), out.stride(1), out.stride(2), SPLITS=splits, BLOCK_M=bm, BLOCK_K=BLOCK_K,
            RANK_BLOCK=_rank_block(rank), DOT_PRECISION=_precision(x.dtype), num_warps=4)
    return out


def launch_lora_expand(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor,
                       scales: torch.Tensor, part_starts: list[int]) -> torch.Tensor:
    if shrunk.dim() == 3:  # one partial: the sum itself (the reference's output)
        shrunk = shrunk.unsqueeze(0)
    splits, t, parts, rank = shrunk.shape
    slots = b.shape[0]
    if shrunk.stride(3) != 1 or b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("shrunk, b and y need a contiguous last dimension")
    widest = max(hi - lo for lo, hi in zip(part_starts, part_starts[1:]))
    starts = _device_starts(tuple(part_starts), y.device)
    if t and slots and widest:
        bm, bn = _block_m(t), 64
        _lora_expand_kernel[(triton.cdiv(t, bm), triton.cdiv(widest, bn), slots * parts)](
            shrunk, b, y, row_slots, scales, starts, t, rank, shrunk.stride(0), shrunk.stride(1),
            shrunk.stride(2), b.stride(0), b.stride(1), y.stride(0), SPLITS=splits, NUM_PARTS=parts, BLOCK_M=bm, BLOCK_N=bn,
            RANK_BLOCK=_rank_block(rank), DOT_PRECISION=_precision(y.dtype), num_warps=4)
    return y
