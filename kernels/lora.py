"""Batched LoRA: every row of a step adds its own adapter's low-rank update to a linear's output,
y[t] += scale[s] * (x[t] A[s]^T) B[s]^T with s = row_slots[t] (-1: the base model, nothing added).

Two launches a linear (Punica's and S-LoRA's split): shrink, x [T, K] times each stacked part's
A [R, K] of the row's slot into float32 partial sums [S_K, T, P, R] over splits of K (a decode
step's few rows need K split to fill the GPU; their sum is x A^T); expand sums them and adds
that times the part's B [N_p, R] into the part's columns of y. The adapters live in fixed device buffers (`a` [S, P, R, K], `b`
[S, N, R]: S slots, P stacked parts such as q/k/v, R the largest rank, smaller ranks zero-padded),
and the only per-step input is `row_slots` [T]: the grid depends on T, S and the shapes alone,
nothing is read on the host, so a CUDA graph captures the launches and replays them with new
slots. A program handles one block of rows for one slot and leaves at once when no row of the
block uses it, so a prefill chunk (one adapter over many rows) costs one adapter's work and a
decode batch of mixed adapters costs one pass per adapter present.

Accumulation in float32; x, the buffers and y share one dtype. The references are plain torch
(what the engine runs on the CPU), one matmul pair per slot present."""
from __future__ import annotations

import torch


def _check(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> None:
    if a.dim() != 4:
        raise ValueError(f"a must be [slots, parts, rank, in], got {tuple(a.shape)}")
    if x.dim() != 2 or x.shape[1] != a.shape[3]:
        raise ValueError(f"x {tuple(x.shape)} does not match a's input width {a.shape[3]}")
    if row_slots.shape != (x.shape[0],):
        raise ValueError(f"row_slots {tuple(row_slots.shape)} must hold one slot per row of x ({x.shape[0]})")


def _check_expand(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, part_starts: list[int]) -> None:
    t, parts, rank = shrunk.shape[-3:]
    if b.dim() != 3 or b.shape[2] != rank:
        raise ValueError(f"b must be [slots, out, {rank}], got {tuple(b.shape)}")
    if len(part_starts) != parts + 1 or part_starts[0] != 0 or part_starts[-1] != b.shape[1]:
        raise ValueError(f"part_starts {part_starts} must run from 0 to b's {b.shape[1]} rows in {parts} parts")
    if y.shape != (t, b.shape[1]):
        raise ValueError(f"y {tuple(y.shape)} must be [{t}, {b.shape[1]}]")


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """[T, P, R]: x's rows times their slot's A of every part (zeros for base rows)."""
    _check(x, a, row_slots)
    slots, parts, rank, _ = a.shape
    out = torch.zeros(x.shape[0], parts, rank, dtype=x.dtype, device=x.device)
    for s in row_slots.unique().tolist():
        if not 0 <= s < slots:
            continue
        rows = (row_slots == s).nonzero().squeeze(1)
        out[rows] = (x[rows] @ a[s].reshape(parts * rank, -1).t()).view(-1, parts, rank)
    return out


def lora_expand_reference(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor,
                          scales: torch.Tensor, part_starts: list[int]) -> torch.Tensor:
    """y[t, part p's columns] += scales[s] * shrunk[t, p] @ B[s, part p's rows]^T, in place."""
    _check_expand(shrunk, b, y, part_starts)
    for s in row_slots.unique().tolist():
        if not 0 <= s < b.shape[0]:
            continue
        rows = (row_slots == s).nonzero().squeeze(1)
        for p in range(shrunk.shape[1]):
            lo, hi = part_starts[p], part_starts[p + 1]
            delta = (shrunk[rows, p] @ b[s, lo:hi].t()) * scales[s].to(y.dtype)
            y[rows, lo:hi] += delta
    return y


def lora_shrink(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """Triton; float32 partial sums [S_K, T, P, R] whose sum over the first dimension is the
    reference's [T, P, R]. Rows of the base model (slot -1) are left unwritten: the expand skips them."""
    _check(x, a, row_slots)
    from kernels.triton_lora import launch_lora_shrink
    return launch_lora_shrink(x, a, row_slots)


def lora_expand(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor,
                scales: torch.Tensor, part_starts: list[int]) -> torch.Tensor:
    """Triton; adds each adapter row's update into y (in place) and returns y. `shrunk`: the
    reference's [T, P, R] or lora_shrink's partial sums [S_K, T, P, R]."""
    _check_expand(shrunk, b, y, part_starts)
    from kernels.triton_lora import launch_lora_expand
    return launch_lora_expand(shrunk, b, y, row_slots, scales, part_starts)
