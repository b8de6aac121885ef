"""Linear layers at decode batch sizes (M <= 16 rows): y = x W^T (+ bias), and the MLP's
gate/up projection fused with SwiGLU, silu(x W_g^T) * (x W_u^T).

At these sizes a linear is a read of its weight: the flops are negligible, so the
Triton kernel is built to read every weight element once at copy bandwidth (16-byte
loads, split-K so that small-N shapes still fill every SM, a deterministic in-kernel
reduction of the split partials). fp32 accumulation; x, W, bias and the output share
one dtype (bf16, fp16 or fp32). CUDA-graph capturable (no host sync; the grid depends
only on shapes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernels.pdl import Pdl
from kernels.small_batch_linear_config import (MAX_M, PARTIAL_FLOATS, SmallBatchConfig, get_config, gpu_key,
                                               tuned_config)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def small_batch_supported(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """True when the kernel applies to an [m, k] x [n, k]^T product: 1..16 rows, a
    supported dtype, and weight rows that are whole 16-byte vectors (k * itemsize % 16 == 0,
    which the full-speed loads need). It says nothing about tensor layout: the call
    checks that (last dims contiguous)."""
    if dtype not in _DTYPES or not 1 <= m <= MAX_M or n < 1:
        return False
    return k >= 1 and (k * dtype.itemsize) % 16 == 0


def small_batch_preferred(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Where the engine should route a linear here instead of cuBLAS: supported and 16-bit.
    fp32 runs correctly but its dot is IEEE fp32 on CUDA cores, and its summation order
    differs from cuBLAS's (fp32 is what the token-for-token HF parity tests run)."""
    return dtype in (torch.bfloat16, torch.float16) and small_batch_supported(m, n, k, dtype)


def device_gpu_key(device: torch.device) -> str:
    """Which per-GPU tuned table applies on this device ("" on CPU or an untuned GPU)."""
    if device.type != "cuda":
        return ""
    return _gpu_key_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_key_of(index: int) -> str:
    return gpu_key(torch.cuda.get_device_name(index))


def small_batch_tuned(x: torch.Tensor, w: torch.Tensor, gate_up: bool = False) -> bool:
    """The device sweep has a tiling for this GPU, shape and batch bucket: there the kernel
    measured faster than cuBLAS (the engine's "auto" routing)."""
    return tuned_config(x.shape[0], w.shape[0], w.shape[1], device_gpu_key(x.device), gate_up) is not None


@dataclass
class SmallBatchWorkspace:
    """Split-K scratch: fp32 partials and one int32 arrival counter per output tile.

    The counters must start at zero; every launch leaves them at zero. Allocate one
    up front (before CUDA-graph capture) per stream that runs these kernels: two launches
    in flight at once must not share a workspace. tuned_only: the layers holding this
    workspace use the kernel only where small_batch_tuned (a view of the same buffers:
    `dataclasses.replace(ws, tuned_only=True)`). fp8_decode_gemm: FP8 linears holding this
    workspace send 2..32 rows to the W8A8 decode GEMM where it runs (kernels/fp8_linear.py);
    False keeps them on this kernel (W8A16)."""

    partials: torch.Tensor
    counters: torch.Tensor
    tuned_only: bool = False
    fp8_decode_gemm: bool = True

    @classmethod
    def create(cls, device, max_partial_floats: int = PARTIAL_FLOATS, max_tiles: int = 1 << 13) -> "SmallBatchWorkspace":
        """Defaults (16 MiB + 32 KiB) cover split_k * (2 for gate/up) * M * N up to 4M floats
        (e.g. 32 splits of a 16 x 8192 output) and 8192 split tiles; a call that needs more
        raises ValueError (checked on shapes, before any launch)."""
        return cls(torch.empty(max_partial_floats, dtype=torch.float32, device=device),
                   torch.zeros(max_tiles, dtype=torch.int32, device=device))

    def buffers(self, partial_floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        if partial_floats > self.partials.numel() or tiles > self.counters.numel():
            raise ValueError(
                f"workspace too small: need {partial_floats} partial floats and {tiles} counters, "
                f"have {self.partials.numel()} and {self.counters.numel()}")
        return self.partials, self.counters


def small_batch_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch: float32 math (float64 for float64 inputs), rounded to x's dtype once."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ w.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def small_batch_gate_up_silu_reference(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x W_g^T) * (x W_u^T) with W_g = w_gate_up[:I], W_u = w_gate_up[I:], float32
    math, rounded once (the unfused path rounds the [M, 2I] product first)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    gate, up = (x.to(acc) @ w_gate_up.to(acc).T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _check(x, w, bias, out, n_out):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"small_batch_linear handles 1..{MAX_M} rows, got {m}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one of {_DTYPES}, got {x.dtype} and {w.dtype}")
    if w.stride(1) != 1:
        raise ValueError("w's last dimension must be contiguous")
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n_out}] of {x.dtype}")
    if out is not None and (out.shape != (m, n_out) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n_out}] of {x.dtype} with a contiguous last dimension")


def _run(x, w, bias, out, config, workspace, gate_up, pdl=None):
    n_out = w.shape[0] // 2 if gate_up else w.shape[0]
    _check(x, w, bias, out, n_out)
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 8
        config = get_config(x.shape[0], w.shape[0], x.shape[1], x.element_size(), num_sms, gate_up,
                            device_gpu_key(x.device))
    if out is None:
        out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    from kernels.triton_small_batch_linear import launch_small_batch_linear

    return launch_small_batch_linear(x, w, bias, out, config, workspace, gate_up, pdl)


def small_batch_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       out: Optional[torch.Tensor] = None, config: Optional[SmallBatchConfig] = None,
                       workspace: Optional[SmallBatchWorkspace] = None, pdl: Optional[Pdl] = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N], M <= 16 (Triton).
    config: None picks the tuned/heuristic tiling (kernels/small_batch_linear_config.py).
    workspace: split-K scratch; None allocates it per call (fine eagerly; under CUDA graphs
    pass one made beforehand, else each replay also runs a memset).
    pdl: launch with programmatic dependent launch (kernels/pdl.py; only where pdl_supported)."""
    return _run(x, w, bias, out, config, workspace, gate_up=False, pdl=pdl)


def small_batch_gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, out: Optional[torch.Tensor] = None,
                             config: Optional[SmallBatchConfig] = None,
                             workspace: Optional[SmallBatchWorkspace] = None,
                             pdl: Optional[Pdl] = None) -> torch.Tensor:
    """silu(x @ w_gate_up[:I]^T) * (x @ w_gate_up[I:]^T) -> [M, I] for w_gate_up [2I, K]
    (gate rows first, as the MLP's stacked gate_up_proj), one launch, no [M, 2I] round trip."""
    if w_gate_up.dim() == 2 and w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up must have an even number of rows (gate and up), got {w_gate_up.shape[0]}")
    return _run(x, w_gate_up, None, out, config, workspace, gate_up=True, pdl=pdl)
