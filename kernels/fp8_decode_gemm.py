"""FP8 linears at decode sizes (1..32 rows): W8A8 with x quantized inside the GEMM.

A decode step's linears are a read of the weights. The W8A16 small-batch kernel
(kernels/small_batch_linear.py) widens every FP8 weight in registers (e4m3 -> fp16 -> fp32,
then an FMA), and that widening, not the bytes, sets its pace once there is more than one row.
This kernel widens nothing: each K step quantizes x's slice to FP8 (per row per group of 128
columns, the prefill's recipe, as SGLang and vLLM run block-FP8 models at every batch size), and
the FP8 tensor cores take the weight tile as the MMA's M side ("swap AB": 64 or 128 weight rows
against x's rows padded to 16), each step's dot promoted with both scales
(triton_fp8_decode_gemm.py). So it beats the small-batch kernel from 2 to 32 rows, and is level
with its tuned tiles at one row. Each K step quantizes x's tile in every program, work that grows
with the rows, so past 32 the M-tiled W8A8 GEMM takes over. From PREQUANT_MIN_M rows a small
kernel quantizes x once before the GEMM and the programs read FP8 x (the same values, the same
_quantize_rows); below it the extra launch costs more than it saves. Where the RMSNorm before qkv and gate/up can write its output in
FP8 (kernels.rms_norm.rms_norm_fp8_rows, from FUSED_QUANT_MIN_M rows), the GEMM takes those bytes
and scales (x_fp8) and neither quantizes nor launches anything for x: the same values, the same
output to the bit. kernels/fp8_linear.py sends it 2..32 rows, and one row of a shape the
small-batch sweep did not tune. Figures: docs/performance/fp8.md.

Numerics are W8A8's (fp8_decode_reference): the activation rounding the small-batch kernel
avoided, the same as the prefill path's. Needs Hopper (FP8 MMA and TMA) or Triton's interpreter;
elsewhere kernels.fp8_linear keeps the small-batch kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernels.fp8 import ACT_EPS, ACT_GROUP, FP8_DTYPE, FP8_MAX, Fp8Rows, Fp8Weight

# past 32 rows the M-tiled W8A8 GEMM (cuBLAS from 128) takes over: every program quantizes x's
# whole tile each K step, work that grows with the rows until it outweighs the weight's bytes
FP8_DECODE_MAX_M = 32

_GROUPS = (32, 64, 128)  # activation groups the K step can be (an FP8 dot takes K >= 32)
# From this many rows x is quantized once by its own kernel before the GEMM (Fp8DecodeConfig.
# prequant): at 32 rows per-program quantization is as much work a K step as the weight tile it
# multiplies; at 8 the extra launch outweighs it. 33: never
PREQUANT_MIN_M = 17
# From this many rows the RMSNorm before qkv and gate/up writes x in FP8 for the decode GEMM
# (kernels.rms_norm.rms_norm_fp8_rows), which then neither quantizes x per K step nor launches
# the quantization kernel above. Below 17 rows PDL already overlaps the quantization launches and
# the norm's FP8 write costs about what it saves (docs/performance/fp8.md). 33: never
FUSED_QUANT_MIN_M = 17


@dataclass(frozen=True)
class Fp8DecodeConfig:
    """block_n: weight rows a program (the MMA's M side: 64 or 128 on the GPU); split_k: K
    ranges the weight rows are split into (the wrapper caps it to the workspace)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    # x quantized once by its own small kernel before the GEMM, instead of each program
    # quantizing its x slice every K step (the same values: _quantize_rows either way)
    prequant: bool = False


def decode_config(m: int, n_rows: int, k: int, num_sms: int, gate_up: bool, group: int,
                  device: torch.device) -> Fp8DecodeConfig:
    """Tilings from a sweep of Qwen3-8B's linears as a decode step calls them (they hold on Hopper
    GPUs of either memory, docs/performance/fp8.md): 3 stages; 64-row tiles from 2 to 16 rows and for
    the wide gate/up weight, 128 otherwise; 8 warps past 16 rows but for gate/up and the long-K
    down; K splits for about two programs an SM (four on 64-row tiles but gate/up's). From
    PREQUANT_MIN_M rows x is quantized before the GEMM, on 64-row tiles, 4 warps and stages, about
    one program an SM. n_rows: the weight's rows (both halves for gate/up). Small tiles in the
    interpreter."""
    wide = n_rows >= 16384
    prequant = m >= PREQUANT_MIN_M
    stages = 1 if device.type != "cuda" else 3
    if device.type != "cuda":
        block_n, warps, per_sm = 32, 4, 2
    elif prequant:  # the same sweep's best for every shape at 32 rows: few splits, 4 stages
        block_n, warps, per_sm, stages = 64, 4, 1, 4
    else:
        block_n = 64 if wide or 1 < m <= 16 else 128
        warps = 8 if m > 16 and not wide and k < 8192 else 4
        per_sm = 2 if gate_up or block_n == 128 else 4
    tiles = -(-(n_rows // 2 if gate_up else n_rows) // block_n)
    steps = -(-k // group)
    split = max(1, min(steps, -(-per_sm * num_sms // tiles)))
    return Fp8DecodeConfig(block_n, warps, stages, split, prequant)


def decode_group(w: Fp8Weight) -> Optional[int]:
    """The activation group (and K step) for this weight, or None where the kernel cannot run it."""
    group = min(ACT_GROUP, w.group_k)
    return group if group in _GROUPS and w.group_k % group == 0 else None


def fp8_decode_shape_ok(x: torch.Tensor, w: Fp8Weight) -> bool:
    """1..32 rows of a 16-bit or fp32 x, a 2-D weight whose rows start on 16 bytes (TMA) and a
    group the kernel takes: what fp8_decode_linear runs on a Hopper GPU."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= FP8_DECODE_MAX_M or x.shape[1] % 16:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.q.dim() != 2 or w.q.dtype != FP8_DTYPE:
        return False
    return w.q.stride(0) % 16 == 0 and w.q.stride(1) == 1 and w.q.data_ptr() % 16 == 0 and decode_group(w) is not None


def fp8_decode_supported(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether fp8_decode_linear runs x against w here: fp8_decode_shape_ok, on a Hopper GPU
    with TMA (or in Triton's interpreter)."""
    if not fp8_decode_shape_ok(x, w):
        return False
    if x.is_cuda:
        return hopper_with_tma(x.device.index if x.device.index is not None else torch.cuda.current_device())
    from kernels.availability import triton_interpret_enabled
    return triton_interpret_enabled()


@functools.lru_cache(maxsize=None)
def hopper_with_tma(index: int) -> bool:
    """Compute capability 9+ and a Triton with host TMA descriptors (asked once a device: the
    route asks at every eager decode-size call)."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_rows_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode GEMM's activation quantization: per row and group, scale = max(max|x|, eps) / 448
    (per_token_group_quant_reference's) and q = x * (448 / max(max|x|, eps)) in float32 (a
    multiply by the reciprocal where the prefill's kernel divides: within an ulp of it before
    the FP8 rounding). Returns (q as float32 values on the FP8 grid [M, K], scales [M, groups])."""
    m, k = x.shape
    g = -(-k // group)
    xf = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.to(torch.float32)
    xg = xf.view(m, g, group)
    amax = xg.abs().amax(dim=-1).clamp_min(ACT_EPS)
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (xg * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
    return q.view(m, g * group)[:, :k], amax / FP8_MAX


def fp8_decode_reference(x: torch.Tensor, w: Fp8Weight, bias=None, gate_up: bool = False) -> torch.Tensor:
    """What fp8_decode_linear computes: x quantized per row per group (quantize_rows_reference),
    times the dequantized weight in float64, rounded once to x's dtype (gate_up: silu(gate) * up
    of the float64 product, then rounded)."""
    group = decode_group(w) or ACT_GROUP
    xq, xs = quantize_rows_reference(x, group)
    xd = xq.double() * xs.double().repeat_interleave(group, dim=-1)[:, :x.shape[1]]
    y = xd @ w.dequantize(torch.float64).T
    if bias is not None:
        y = y + bias.double()
    if gate_up:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y.to(x.dtype)


def fp8_decode_linear(x: torch.Tensor, w: Fp8Weight, bias=None, *, out=None, config=None, workspace=None,
                      pdl=None, gate_up: bool = False, x_fp8: Optional[Fp8Rows] = None) -> torch.Tensor:
    """Triton: x [M <= 32, K] -> [M, N] in x's dtype (gate_up: silu(x W_g^T) * (x W_u^T) for the
    stacked [2I, K] weight -> [M, I]). workspace: a kernels.small_batch_linear.SmallBatchWorkspace
    for split-K (None: buffers per call); a split it cannot hold is narrowed. x_fp8: x already
    quantized by the kernel that made it (kernels.rms_norm.rms_norm_fp8_rows): the GEMM reads it
    instead of quantizing x (the same values, so the same result to the bit)."""
    if not fp8_decode_supported(x, w):
        raise ValueError(f"fp8_decode_linear takes 1..{FP8_DECODE_MAX_M} rows, K % 16 == 0 and a 2-D FP8 weight "
                         f"of a 32/64/128-column group on Hopper, got x {tuple(x.shape)}, weight {tuple(w.q.shape)}")
    n_rows, k = w.q.shape
    n_out = n_rows // 2 if gate_up else n_rows
    if x.shape[1] != k or (gate_up and n_rows % 2):
        raise ValueError(f"x {tuple(x.shape)} does not fit the weight {tuple(w.q.shape)}")
    if bias is not None and (gate_up or bias.shape != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n_out}] of {x.dtype} (and none for gate/up)")
    if x.stride(1) != 1:
        x = x.contiguous()
    group = decode_group(w)
    m = x.shape[0]
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
        config = decode_config(m, n_rows, k, sms, gate_up, group, x.device)
    if x_fp8 is not None:
        _check_rows(x_fp8, x, group)
        config = replace(config, prequant=True)
    if workspace is not None:
        config = _fit(config, workspace, m, n_out, gate_up)
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    from kernels.triton_fp8_decode_gemm import launch_fp8_decode_gemm
    return launch_fp8_decode_gemm(x, w, bias, out, config, workspace, gate_up, pdl, group, ACT_EPS, x_fp8)


def _check_rows(x_fp8: Fp8Rows, x: torch.Tensor, group: int) -> None:
    m, k = x.shape
    if x_fp8.group != group or x_fp8.q.shape != (m, k) or x_fp8.q.dtype != FP8_DTYPE or x_fp8.q.stride(1) != 1:
        raise ValueError(f"x_fp8 must be x's rows [{m}, {k}] in FP8 quantized by groups of {group}, got "
                         f"{tuple(x_fp8.q.shape)} {x_fp8.q.dtype} by {x_fp8.group}")
    if x_fp8.scales.shape != (m, -(-k // group)) or x_fp8.scales.dtype != torch.float32 or (
            x_fp8.scales.shape[1] > 1 and x_fp8.scales.stride(1) != 1):
        raise ValueError(f"x_fp8's scales must be float32 [{m}, {-(-k // group)}] with contiguous rows")


def _fit(config: Fp8DecodeConfig, workspace, m: int, n_out: int, gate_up: bool) -> Fp8DecodeConfig:
    """config with split_k narrowed until its partials and counters fit the workspace."""
    tiles = -(-n_out // config.block_n)
    split = config.split_k
    while split > 1 and (split * (2 if gate_up else 1) * m * n_out > workspace.partials.numel()
                         or tiles > workspace.counters.numel()):
        split -= 1
    return config if split == config.split_k else replace(config, split_k=split)
