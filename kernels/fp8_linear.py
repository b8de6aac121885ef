"""Linear layers over FP8 weights (kernels/fp8.py's Fp8Weight): y = x W^T (+ bias).

Three paths, picked by the number of rows, as SGLang and vLLM do:
- decode sizes (M <= 32) on Hopper: x quantized per token per group of 128 columns inside the
  GEMM, each K step an FP8 tensor-core dot with the weight tile as the MMA's M side
  (kernels/fp8_decode_gemm.py): a decode step is a read of the weights, FP8 halves it, and
  nothing is widened on the way. The gate/up + SwiGLU fusion works the same way. Where the
  RMSNorm before the linear wrote x in FP8 for it (fp8_rows_group: the layer asks, the norm's
  kernel quantizes, x_fp8 carries the bytes), the GEMM skips its own quantization.
  One row of a shape the small-batch sweep tuned, and elsewhere (other GPUs, a group the kernel
  cannot step by, --fp8-decode-gemm off) up to 32 rows: the split-K small-batch kernel
  (kernels/small_batch_linear.py), which widens each FP8 weight in registers (W8A16, no
  activation rounding; as fast at one row with its tuned tiles, slower from 2).
- larger M (prefill, big decode batches): activations quantized per token per group of 128
  columns (one launch), then a W8A8 GEMM on the FP8 tensor cores with the scales applied
  per K step (triton_fp8_gemm.py), DeepSeek-V3's recipe; from 128 rows, on weights in the plain
  128x128 block layout, cuBLAS's block-scaled GEMM where torch and the GPU have it
  (kernels/fp8_cublas.py: 79-91% of the FP8 peak at prefill sizes against Triton's 49-58%).
All are CUDA-graph safe (no host sync; grids depend on shapes only). x, bias and the output
share one dtype (bf16, fp16 or fp32); accumulation in fp32.

Each Triton function has its torch reference here; `fp8_linear_reference` follows the same
route (on the CPU, the route a Hopper GPU takes), so kernels and references agree closely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.fp8 import (ACT_EPS, ACT_GROUP, FP8_DTYPE, Fp8Rows, Fp8Weight, dequantize_activations,
                         per_token_group_quant_reference)
from kernels.fp8_cublas import cublas_fp8_linear, cublas_route
from kernels import fp8_decode_gemm as decode_gemm_module  # FUSED_QUANT_MIN_M read at call time (benches patch it)
from kernels.fp8_decode_gemm import (decode_group, fp8_decode_linear, fp8_decode_reference, fp8_decode_shape_ok,
                                     fp8_decode_supported)
from kernels.small_batch_linear_config import FP8_MAX_M

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """W8A8 GEMM tiling; block_k is the activation group (one scale per row and K step);
    tma: tiles through tensor descriptors (else pointer loads); k_pairs: two K steps an
    iteration (both dots in flight before either is scaled)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = ACT_GROUP
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    k_pairs: bool = False


def gemm_config(m: int, n: int, block_k: int, device: torch.device) -> Fp8GemmConfig:
    """Tilings from a sweep over Qwen3-8B's linears (docs/performance/fp8.md): TMA tiles
    throughout; long prefills 128 x 128 with 8 warps,
    3 stages and K steps in pairs; 33..64 rows narrow N tiles (64 columns, 6 stages; 32 with
    pairs for 4096-wide outputs) so an output still has 64-128 programs for 132 SMs. Small
    tiles in the interpreter."""
    if device.type != "cuda":
        return Fp8GemmConfig(16, 32, block_k, 1, 4, 1)
    if m <= 64:
        if n > 4096:
            return Fp8GemmConfig(64, 64, block_k, 1, 4, 6, tma=True)
        return Fp8GemmConfig(64, 32, block_k, 1, 4, 4, tma=True, k_pairs=True)
    if m >= 4096:
        return Fp8GemmConfig(128, 128, block_k, 8, 8, 3, tma=True, k_pairs=True)
    return Fp8GemmConfig(64, 128, block_k, 8, 4, 4, tma=True)


def act_group(w: Fp8Weight) -> int:
    """Activation columns per scale for this weight: 128, or its block's K when smaller."""
    group = min(ACT_GROUP, w.group_k)
    if w.group_k % group:
        raise ValueError(f"weight scale group of {w.group_k} columns is not a multiple of {group}")
    return group


def _use_triton(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    from kernels.availability import triton_interpret_enabled
    return triton_interpret_enabled()


def _check(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor], n_out: int) -> None:
    if x.dim() != 2 or w.q.dim() != 2 or x.shape[1] != w.q.shape[1]:
        raise ValueError(f"x must be [M, K] and the weight [N, K], got {tuple(x.shape)} and {tuple(w.q.shape)}")
    if w.q.dtype != FP8_DTYPE or w.scale.dtype != torch.float32 or w.scale_row.dtype != torch.int32:
        raise ValueError("an Fp8Weight holds float8_e4m3fn values, float32 scales and int32 scale rows")
    if w.scale_row.shape != (w.q.shape[0],) or w.q.stride(1) != 1:
        raise ValueError("scale_row must be [N] and the weight's last dimension contiguous")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be one of {_X_DTYPES}, got {x.dtype}")
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n_out}] of {x.dtype}")


# -- activation quantization ----------------------------------------------------------------
def per_token_group_quant(x: torch.Tensor, group: int = ACT_GROUP,
                          m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K/group)]), the
    same values as kernels.fp8.per_token_group_quant_reference. m_major: the scales stored
    column by column (stride (1, M)), as cuBLAS's block-scaled GEMM reads them."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dimension, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    groups = -(-k // group)
    if m_major:
        s = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    from kernels.triton_fp8_gemm import launch_group_quant
    launch_group_quant(x, q, s, group, ACT_EPS)
    return q, s


# -- W8A8 GEMM -------------------------------------------------------------------------------
def w8a8_gemm_reference(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, bias=None,
                        out_dtype: torch.dtype = torch.bfloat16, group: int = ACT_GROUP) -> torch.Tensor:
    """Dequantized activations times the dequantized weight, in float64, rounded once."""
    x = dequantize_activations(xq, xs, group).double()
    y = x @ w.dequantize(torch.float64).T
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def w8a8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, bias=None, out_dtype: torch.dtype = torch.bfloat16,
              out: Optional[torch.Tensor] = None, config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """Triton: xq [M, K] FP8 with per-token-group scales xs [M, ceil(K/block_k)], times the
    FP8 weight [N, K]^T -> [M, N] in out_dtype."""
    m, k = xq.shape
    n = w.q.shape[0]
    group = act_group(w)
    if config is None:
        config = gemm_config(m, n, group, xq.device)
    if config.block_k != group:
        raise ValueError(f"the GEMM's K step ({config.block_k}) must be the activation group ({group})")
    if xs.shape != (m, -(-k // group)) or (xs.shape[1] > 1 and xs.stride(1) != 1):
        raise ValueError(f"activation scales must be [{m}, {-(-k // group)}] with a contiguous last dimension "
                         f"(not per_token_group_quant's m_major ones), got {tuple(xs.shape)} {xs.stride()}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    from kernels.triton_fp8_gemm import launch_w8a8_gemm
    uniform = not w.per_channel and w.tile_n >= config.block_n
    return launch_w8a8_gemm(xq, xs, w.q, w.scale, w.scale_row, w.group_k, bias, out, config, uniform)


# -- small batches ----------------------------------------------------------------------------
def small_batch_fp8_supported(m: int, k: int, dtype: torch.dtype) -> bool:
    """1..32 rows of a 16-bit or fp32 x, weight rows of whole 16-byte vectors (K % 16 == 0)."""
    return 1 <= m <= FP8_MAX_M and dtype in _X_DTYPES and k % 16 == 0


def small_batch_fp8_reference(x: torch.Tensor, w: Fp8Weight, bias=None) -> torch.Tensor:
    """W8A16: x times the dequantized weight in float64, rounded once to x's dtype."""
    y = x.double() @ w.dequantize(torch.float64).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def gate_up_silu_fp8_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    gate, up = (x.double() @ w.dequantize(torch.float64).T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _small_batch_config(x: torch.Tensor, w: Fp8Weight, gate_up: bool, config):
    from kernels.small_batch_linear import device_gpu_key
    from kernels.small_batch_linear_config import get_config

    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
        config = get_config(x.shape[0], w.q.shape[0], x.shape[1], 1, num_sms, gate_up, device_gpu_key(x.device))
    from kernels.triton_small_batch_linear import fp8_sub_k

    if fp8_sub_k(config.block_k, w.group_k) < 16:  # a sub-tile row must sit inside one scale group
        raise ValueError(f"no K tile of >= 16 columns divides the weight's scale group of {w.group_k}")
    return config


def small_batch_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias=None, out=None, config=None, workspace=None,
                           pdl=None, gate_up: bool = False) -> torch.Tensor:
    """Triton (the small-batch kernel with FP8 weights): x [M <= 32, K] -> [M, N] in x's dtype;
    gate_up: silu(x W_g^T) * (x W_u^T) for the stacked [2I, K] weight -> [M, I]."""
    n_out = w.q.shape[0] // 2 if gate_up else w.q.shape[0]
    _check(x, w, bias, n_out)
    if not small_batch_fp8_supported(x.shape[0], x.shape[1], x.dtype):
        raise ValueError(f"small_batch_fp8_linear takes 1..{FP8_MAX_M} rows and K % 16 == 0, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    config = _small_batch_config(x, w, gate_up, config)
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    from kernels.triton_small_batch_linear import launch_small_batch_linear
    return launch_small_batch_linear(x, w.q, bias, out, config, workspace, gate_up, pdl, fp8=w)


# -- the layer's entry points -----------------------------------------------------------------
def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias=None) -> torch.Tensor:
    """What fp8_linear computes, in torch: W8A8 with activations quantized per token group where
    the decode GEMM runs (on the CPU: where it would run on Hopper), else W8A16 up to 32 rows;
    past that activations quantized per token group and W8A8."""
    m, k = x.shape
    if _decode_gemm_takes(x, w, None, on_hopper=not x.is_cuda):
        return fp8_decode_reference(x, w, bias)
    if small_batch_fp8_supported(m, k, x.dtype):
        return small_batch_fp8_reference(x, w, bias)
    group = act_group(w)
    xq, xs = per_token_group_quant_reference(x, group)
    return w8a8_gemm_reference(xq, xs, w, bias, x.dtype, group)


def _decode_gemm_takes(x: torch.Tensor, w: Fp8Weight, workspace, gate_up: bool = False,
                       on_hopper: bool = False) -> bool:
    """Whether x goes through the decode GEMM: the engine's --fp8-decode-gemm (carried by the
    layers' workspace; on without one), a size and weight the kernel runs here (on_hopper: would
    run on Hopper, for the CPU's references), and past one row, or at one row where the
    small-batch kernel has no tuned tiling for the shape (its heuristic tiles are far slower at
    one row, e.g. on tensor-parallel shards, where the decode GEMM's tiles follow a rule; every
    Hopper GPU reads the same FP8 table, and the references read it too)."""
    if workspace is not None and not workspace.fp8_decode_gemm:
        return False
    if not (fp8_decode_shape_ok(x, w) if on_hopper else fp8_decode_supported(x, w)):
        return False
    if x.shape[0] > 1:
        return True
    from kernels.small_batch_linear import device_gpu_key
    from kernels.small_batch_linear_config import tuned_config

    n, k = w.q.shape
    return tuned_config(1, n, k, device_gpu_key(x.device) or "H200", gate_up, fp8=True) is None


def fp8_rows_group(x: torch.Tensor, w: Fp8Weight, workspace=None, gate_up: bool = False) -> Optional[int]:
    """The activation group the decode GEMM would quantize x by for this weight, where it takes x
    and the kernel that makes x should quantize it instead (kernels.rms_norm.rms_norm_fp8_rows:
    from FUSED_QUANT_MIN_M rows, where the GEMM would otherwise pay for its own quantization);
    else None. x: the rows the norm is about to normalise (same shape, dtype, device)."""
    if x.dim() != 2 or x.shape[0] < decode_gemm_module.FUSED_QUANT_MIN_M or not x.is_cuda:
        return None
    if not _decode_gemm_takes(x, w, workspace, gate_up):
        return None
    return decode_group(w)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None, *, workspace=None,
               pdl=None, x_fp8: Optional[Fp8Rows] = None) -> torch.Tensor:
    """y = x W^T (+ bias) for an FP8 weight, by the route in the module note; x [..., K]. On a
    device without Triton (the CPU), the reference. x_fp8: x's rows already quantized for the
    decode GEMM (fp8_rows_group), used where that GEMM runs."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    _check(x2, w, bias, w.q.shape[0])
    if not _use_triton(x2):
        y = fp8_linear_reference(x2, w, bias)
    elif _decode_gemm_takes(x2, w, workspace):
        y = fp8_decode_linear(x2, w, bias, workspace=workspace, pdl=pdl, x_fp8=x_fp8)
    elif small_batch_fp8_supported(x2.shape[0], x2.shape[1], x2.dtype):
        y = small_batch_fp8_linear(x2, w, bias, workspace=workspace, pdl=pdl)
    else:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        if cublas_route(x2, w):
            y = cublas_fp8_linear(x2, w, bias)
        else:
            xq, xs = per_token_group_quant(x2, act_group(w))
            y = w8a8_gemm(xq, xs, w, bias, x2.dtype)
    return y.reshape(*lead, w.q.shape[0])


def fp8_gate_up_silu(x: torch.Tensor, w: Fp8Weight, *, workspace=None, pdl=None,
                     x_fp8: Optional[Fp8Rows] = None) -> Optional[torch.Tensor]:
    """silu(x W_g^T) * (x W_u^T) in one launch at decode sizes (the decode GEMM, else the
    small-batch kernel), or None where neither applies (then the caller runs fp8_linear and
    SwiGLU)."""
    if x.dim() != 2 or not _use_triton(x):
        return None
    if _decode_gemm_takes(x, w, workspace, gate_up=True):
        return fp8_decode_linear(x, w, workspace=workspace, pdl=pdl, gate_up=True, x_fp8=x_fp8)
    if not small_batch_fp8_supported(x.shape[0], x.shape[1], x.dtype):
        return None
    return small_batch_fp8_linear(x, w, workspace=workspace, pdl=pdl, gate_up=True)
