"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is
still finishing: it says so early (griddepcontrol.launch_dependents), and waits
(griddepcontrol.wait) before it reads or writes anything an earlier kernel touches.
What runs before the wait overlaps the previous kernel's tail: the launch itself, and
optionally a linear's first weight tiles pulled into L2 (weights never change during a
step; no longer worth it once the short kernels waited before they signalled: the prefetch
then only competes with the running kernel's reads). Where each kernel signals matters more
than what it prefetches: a
signal on entry lets the next kernel's programs take SM slots and memory bandwidth from
the kernel still running. Works inside CUDA graphs (programmatic edges). SGLang,
TensorRT-LLM and FlashInfer enable the same thing for their decode kernels on Hopper.
Figures for every setting here: docs/performance/pdl.md.

Pure Python: no triton import (the device kernels check `pdl is not None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Launches of up to this many rows take PDL, by the model's weights and kind (one GPU; with tensor
# parallelism one row, not measured past it). Past one row PDL pays only where the kernels it
# overlaps are ours and signal where they should (the loop kernels late from 2 to 16 rows, decode
# attention's K/V prefetch on few rows):
# - FP8 dense: every linear is ours (small-batch GEMV, decode GEMM): to 32 rows;
# - FP8 MoE: the same, and the per-pair experts kernel's launches gain most at two rows: to 32;
# - 16-bit dense: past 16 rows the linears are cuBLAS's, outside PDL, and nothing gains: one row;
# - 16-bit MoE: the per-pair experts kernel (to two tokens) gains, nothing past it: two.
MAX_ROWS = {("fp8", "dense"): 32, ("fp8", "moe"): 32, ("16-bit", "dense"): 1, ("16-bit", "moe"): 2}


@dataclass(frozen=True)
class Pdl:
    """How kernels launch when PDL is on. prefetch_k_blocks: how many of its first
    [BLOCK_N, BLOCK_K] weight tiles each decode-linear program prefetches into L2 before it
    waits for the previous kernel (0, the engine's default: none; the prefetch competes with the
    running kernel's own reads). max_rows: only launches over at most this many rows (tokens,
    sequences) use PDL: early-scheduled programs hold SM slots a running kernel with more rows
    still wants; the engine's by model: MAX_ROWS. late_from_rows..late_to_rows: launches over that many rows
    of the kernels with a main loop (the linears, decode attention's first stage) let the next
    kernel be scheduled only after that loop, as CUTLASS's kernels do after their mainloop, not
    on entry: at 2-16 rows the decode GEMM runs 2-4 programs an SM and the next kernel's early
    programs took slots it still wanted; past 16 (one program an SM) on entry measured as well."""

    prefetch_k_blocks: int = 0
    max_rows: int = 1
    late_from_rows: int = 2
    late_to_rows: int = 16
    # launches over at least this many rows of the short kernels (no main loop: the norms, q/k-norm +
    # RoPE, attention's second stage, the x quantization before a decode GEMM) wait for the kernel
    # before, then let the next be scheduled: signalled on entry, a short kernel launched early let
    # the big kernel after it be scheduled while the big kernel before it still ran, two kernels
    # ahead holding SM slots. The loop kernels at one row keep their early signal: there it lets
    # the next GEMV pull its first tiles, and waiting first slowed the step
    wait_first_from_rows: int = 1

    def __post_init__(self):
        if self.prefetch_k_blocks < 0:
            raise ValueError(f"prefetch_k_blocks must be >= 0, got {self.prefetch_k_blocks}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.late_from_rows < 1:
            raise ValueError(f"late_from_rows must be >= 1, got {self.late_from_rows}")
        if self.wait_first_from_rows < 1:
            raise ValueError(f"wait_first_from_rows must be >= 1, got {self.wait_first_from_rows}")


def engine_pdl(prefetch_k_blocks: int, weights: str, kind: str, tp_size: int = 1) -> Pdl:
    """The engine's Pdl for a model of `weights` ("fp8" or "16-bit") and `kind` ("dense" or "moe"):
    PDL on launches of up to MAX_ROWS rows on one GPU, one row under tensor parallelism (not
    measured past one row there)."""
    rows = MAX_ROWS[(weights, kind)] if tp_size == 1 else 1
    return Pdl(prefetch_k_blocks=prefetch_k_blocks, max_rows=rows)


def pdl_for(pdl: Pdl | None, rows: int) -> Pdl | None:
    """pdl for a launch over `rows` rows, or None where it is not used."""
    return pdl if pdl is not None and rows <= pdl.max_rows else None


def pdl_late(pdl: Pdl | None, rows: int) -> bool:
    """Whether a kernel with a main loop, launched with pdl over `rows` rows, signals the next
    kernel after that loop (triton_pdl.pdl_release) rather than on entry."""
    return pdl is not None and pdl.late_from_rows <= rows <= pdl.late_to_rows


def pdl_wait_first(pdl: Pdl | None, rows: int) -> bool:
    """Whether a short kernel launched with pdl over `rows` rows waits before it signals
    (triton_pdl.pdl_enter's WAIT_FIRST)."""
    return pdl is not None and rows >= pdl.wait_first_from_rows


def pdl_supported(device: torch.device | str) -> bool:
    """A CUDA device of compute capability 9.0 or newer, and a Triton that can launch with
    PDL and emit griddepcontrol (3.4+)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(pdl: Pdl | None) -> dict:
    """Extra keyword arguments for a Triton launch: {} without PDL (also under the CPU
    interpreter, which has no such option)."""
    return {"launch_pdl": True} if pdl is not None else {}
