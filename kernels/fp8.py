"""FP8 (float8_e4m3fn) weights and activations: the formats and their torch references.

Weights, as the engine holds them (`Fp8Weight`): an FP8 tensor [N, K] (or [E, N, K] for
stacked experts) and float32 scales that multiply it, one per (scale row, K group):
    w[n, k] = q[n, k] * scale[scale_row[n], k // group_k]
- block-wise (Hugging Face's `weight_block_size` [128, 128], DeepSeek-V3 and the official
  `*-FP8` releases): `scale` is the checkpoint's `weight_scale_inv` [ceil(N/128), ceil(K/128)]
  and scale_row[n] = n // 128. Stacked parts (q/k/v, gate/up) and tensor-parallel shards
  keep their own scale rows: scale_row maps each weight row to its block's row, so a part
  or a shard may start inside a 128-row block (partial edge blocks included).
- per-channel: scale [N, 1], scale_row[n] = n, group_k >= K. A per-tensor scale becomes
  per-channel (every row of the part gets it): exact, no requantization.

Activations are quantized at run time per token per group of ACT_GROUP columns (dynamic
scheme, as DeepSeek and SGLang do): scale = max|x| / 448 over the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
ACT_GROUP = 128  # activation columns per scale (also the K step of the W8A8 GEMM)
ACT_EPS = 1e-10  # floor of a group's max |x|: an all-zero group gets a tiny scale, not 0
PER_CHANNEL_GROUP_K = 1 << 30  # group_k of a per-channel weight: one K group covers any K


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight and its scales (see the module note). q: float8_e4m3fn [N, K] or
    [E, N, K]; scale: float32 [S, KB] or [E, S, KB]; scale_row: int32 [N]; group_k: weight
    columns per scale column (block_k, or PER_CHANNEL_GROUP_K); tile_n: a power of two such
    that every aligned run of tile_n rows shares one scale row (0: not known; the GEMM then
    reads a scale a column)."""

    q: torch.Tensor
    scale: torch.Tensor
    scale_row: torch.Tensor
    group_k: int
    tile_n: int = 0

    @property
    def per_channel(self) -> bool:
        return self.group_k >= PER_CHANNEL_GROUP_K

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in `dtype` (float32 math, rounded once)."""
        return (self.q.to(torch.float32) * expand_scales(self.scale, self.scale_row, self.group_k,
                                                         self.q.shape[-1])).to(dtype)


@dataclass(frozen=True)
class Fp8Rows:
    """Activation rows already quantized the way the decode GEMM quantizes them (per row per
    group of columns: kernels/fp8_decode_gemm.py quantize_rows_reference), by the kernel that
    produced them (the RMSNorm before qkv and gate/up), so the GEMM skips that step and its launch.
    q: float8_e4m3fn [M, K]; scales: float32 [M, ceil(K / group)], contiguous rows."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int


def expand_scales(scale: torch.Tensor, scale_row: torch.Tensor, group_k: int, k: int) -> torch.Tensor:
    """Per-element scales [..., N, K] from scale [..., S, KB] and scale_row [N]."""
    rows = scale.index_select(-2, scale_row.to(scale.device).long())
    if group_k >= k:
        return rows[..., :1].expand(*rows.shape[:-1], k)
    return rows.repeat_interleave(group_k, dim=-1)[..., :k]


# -- checkpoint formats -------------------------------------------------------------------
def block_scale_rows(n: int, block_n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32) // block_n


def uniform_tile_rows(change_rows, cap: int = 256) -> int:
    """The widest power of two (<= cap) that divides every row where the scale row changes
    (a part's start, a block boundary inside a part): aligned tiles that wide never straddle
    two scale rows."""
    tile = cap
    for r in change_rows:
        if r > 0:
            tile = min(tile, r & -r)
    return tile


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A checkpoint's block-wise FP8 tensor [N, K] (weight_scale_inv [ceil(N/bn), ceil(K/bk)],
    the last row/column of blocks possibly partial) as float32."""
    n, k = q.shape[-2:]
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"block scales of a [{n}, {k}] weight with blocks {bn}x{bk} must be {list(want)}, "
                         f"got {list(scale_inv.shape)}")
    return Fp8Weight(q, scale_inv.to(torch.float32), block_scale_rows(n, bn), bk).dequantize()


def channel_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A checkpoint's per-tensor (one value) or per-channel ([N] or [N, 1]) weight_scale as
    float32 [N, 1]."""
    s = scale.to(torch.float32).reshape(-1)
    if s.numel() == 1:
        return s.expand(n).reshape(n, 1).clone()
    if s.numel() != n:
        raise ValueError(f"weight_scale of a weight with {n} rows must hold 1 or {n} values, got "
                         f"{list(scale.shape)}")
    return s.reshape(n, 1)


def dequantize_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's per-tensor or per-channel FP8 tensor [N, K] as float32."""
    return q.to(torch.float32) * channel_scales(scale, q.shape[0])


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 of a [N, K] weight, as the official FP8 releases are made: per block
    scale_inv = max|w| / 448, q = w / scale_inv (round to nearest even, saturated). Returns
    (q [N, K] float8_e4m3fn, scale_inv float32 [ceil(N/bn), ceil(K/bk)]); partial edge blocks
    take the max over the part of the block that exists."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    wf[:n, :k] = w.to(torch.float32)
    blocks = wf.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 of a [N, K] weight: (q, scale float32 [N, 1])."""
    amax = w.to(torch.float32).abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# -- activations ----------------------------------------------------------------------------
def per_token_group_quant_reference(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, ceil(K/group)]): per row and
    group of `group` columns, scale = max(max|x|, ACT_EPS) / 448 and q = x / scale (the last
    group may be partial)."""
    m, k = x.shape
    g = -(-k // group)
    xf = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.to(torch.float32)
    xg = xf.view(m, g, group)
    scale = xg.abs().amax(dim=-1).clamp_min(ACT_EPS) / FP8_MAX
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, g * group)[:, :k].contiguous(), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    return q.to(torch.float32) * scale.repeat_interleave(group, dim=-1)[:, :q.shape[1]]


# -- KV cache ---------------------------------------------------------------------------------
def kv_cache_values(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a KV cache of cache_dtype stores for x: for FP8, x / scale saturated at +-448 and
    rounded to nearest even (computed as x * (1/scale) in float32, as the kernels do); other
    caches store x in their dtype (the scale is an FP8 cache's only)."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    return (x.to(torch.float32) * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def kv_cache_read(cache_values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The K or V a cache holds, in dtype (an FP8 cache's values times its scale)."""
    if cache_values.dtype != FP8_DTYPE:
        return cache_values.to(dtype)
    return (cache_values.to(torch.float32) * scale).to(dtype)
