"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is
still finishing: it says so early (griddepcontrol.launch_dependents), and waits
(griddepcontrol.wait) before it reads or writes anything an earlier kernel touches.
What runs before the wait overlaps the previous kernel's tail: the launch itself, and
optionally a linear's first weight tiles pulled into L2 (weights never change during a
step; measured no longer worth it once the short kernels waited before they signalled,
kernels/NOTES.md). Where each kernel signals matters more than what it prefetches: a
signal on entry lets the next kernel's programs take SM slots and memory bandwidth from
the kernel still running. Works inside CUDA graphs (programmatic edges). SGLang,
TensorRT-LLM and FlashInfer enable the same thing for their decode kernels on Hopper.

Pure Python: no triton import (the device kernels check `pdl is not None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Launches of up to this many rows take PDL, by the model's weights and kind (one GPU; with tensor
# parallelism one row). H100, the step with PDL on one row over the step with it to 32 rows (the
# linears and decode attention's first stage signalling late from 2 to 16 rows, everything on entry
# past that; attention's K/V prefetch on one row only), kernels/NOTES.md "PDL past one row":
# - FP8 Qwen3-8B: B=4 1.030, 8 1.018, 16 0.996, 17 1.045, 24 1.041, 32 1.025
#   (`fp8_device --sections ceilings,fp8_pdl_past_one_row`);
# - FP8 Qwen3-30B-A3B: B=2 1.078, 8 1.016, 16 1.000, 32 1.003 (`--sections ceilings,fp8_moe_pdl_rows`;
#   an H200: 1.075, 1.017, 1.004, 1.006);
# - 16-bit Qwen3-8B: 0.99-1.01 (its linears past 16 rows are cuBLAS's, outside PDL): one row;
# - 16-bit Qwen3-30B-A3B (H200): B=2 1.043 (the per-pair experts kernel), 8 0.992, 16 0.996, 32 0.994: two.
MAX_ROWS = {("fp8", "dense"): 32, ("fp8", "moe"): 32, ("16-bit", "dense"): 1, ("16-bit", "moe"): 2}


@dataclass(frozen=True)
class Pdl:
    """How kernels launch when PDL is on. prefetch_k_blocks: how many of its first
    [BLOCK_N, BLOCK_K] weight tiles each decode-linear program prefetches into L2 before it
    waits for the previous kernel (0, the engine's default: none; H200, 8B B=1 with 1 against
    0: FP8 0.988, bf16 0.995, `fp8_device --sections ceilings,fp8_pdl_prefetch`). max_rows:
    only launches over at most this many rows (tokens, sequences) use PDL: on an H100 it took
    Qwen3-8B's batch-1 step from 6.18 to 5.94 ms, but made batch 8 slower (6.87 -> 7.12 ms), see
    kernels/NOTES.md; the engine's by model: MAX_ROWS. late_from_rows..late_to_rows: launches over that many rows
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
    # the big kernel after it be scheduled while the big kernel before it still ran. H200, signals on
    # entry over this (kernels/NOTES.md "PDL's short kernels: wait, then signal"): 8B B=1 FP8 1.026,
    # bf16 1.084 (`fp8_device --sections ceilings,fp8_pdl_orders`); FP8 8B B=8..32 1.015-1.027, FP8
    # 30B-A3B B=2/8/32 1.013/1.004/1.009 (`--sections ceilings,fp8_pdl_wait_first`). The loop kernels
    # at one row keep their early signal (waiting first there too: FP8 0.945)
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
