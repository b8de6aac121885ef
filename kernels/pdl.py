"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is
still finishing: it says so early (griddepcontrol.launch_dependents), and waits
(griddepcontrol.wait) before it reads or writes anything an earlier kernel touches.
What runs before the wait overlaps the previous kernel's tail: the small-batch linears
use it to pull their first weight tiles into L2 (weights never change during a step),
which is what a batch-1 decode step spends its time on between the bandwidth-bound
GEMVs. Works inside CUDA graphs (programmatic edges). SGLang, TensorRT-LLM and FlashInfer
enable the same thing for their decode kernels on Hopper.

Pure Python: no triton import (the device kernels check `pdl is not None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pdl:
    """How kernels launch when PDL is on. prefetch_k_blocks: how many of its first
    [BLOCK_N, BLOCK_K] weight tiles each small-batch-linear program prefetches into L2
    before it waits for the previous kernel (0: none)."""

    prefetch_k_blocks: int = 2

    def __post_init__(self):
        if self.prefetch_k_blocks < 0:
            raise ValueError(f"prefetch_k_blocks must be >= 0, got {self.prefetch_k_blocks}")


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
