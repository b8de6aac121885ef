"""FP8 weights in the tensor-parallel layers: a module's weight becomes float8_e4m3fn with
float32 scales and a scale-row map (kernels/fp8.py Fp8Weight), and each rank takes its shard
of a checkpoint's FP8 tensor and of its scales at load.

Layout on a module with an FP8 weight `w` (w = "weight", or an expert stack "w13" / "w2"):
    w            float8_e4m3fn [(E,) N, K]          this rank's rows and columns
    w_scale      float32 [(E,) S, KB]               the scale rows its parts need
    w_scale_row  int32 [N] (buffer)                 the scale row of each weight row
and module.fp8[w] = Fp8Layout (where the shard comes from, how scales cover it).

Sharding rules (what tensor parallelism requires of an FP8 checkpoint):
- rows (column-parallel outputs, stacked q/k/v and gate/up parts, replicated KV heads): any
  split. A part or a shard may start inside a scale block: its scale rows are the blocks it
  touches, and the scale-row map points each weight row at its own block.
- columns (row-parallel inputs: o_proj, down_proj, the experts' down): a rank's first column
  must start a scale block, i.e. (input features / tp) % block_k == 0 when tp > 1. Else the
  load fails naming the layer; expert parallelism (--ep) keeps experts whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from kernels.fp8 import (FP8_DTYPE, PER_CHANNEL_GROUP_K, Fp8Weight, channel_scales, quantize_block,
                         quantize_channel, uniform_tile_rows)

from ..model_config import ModelLoadError


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, start + rows) of one checkpoint tensor that this rank keeps."""
    start: int
    rows: int


@dataclass(frozen=True)
class ScaleGrid:
    """How scales cover a weight: group_n rows and group_k columns a scale (block-wise:
    the block; per-channel: 1 row, every column)."""
    group_n: int
    group_k: int

    @classmethod
    def of(cls, block: tuple[int, int] | None) -> "ScaleGrid":
        return cls(1, PER_CHANNEL_GROUP_K) if block is None else cls(int(block[0]), int(block[1]))

    @property
    def per_channel(self) -> bool:
        return self.group_k >= PER_CHANNEL_GROUP_K


@dataclass(frozen=True)
class Fp8Layout:
    """Where an FP8 weight's shard comes from: its stacked parts' row slices (in order), its
    column slice, the leading expert count (0: none), and the scale grid."""
    parts: tuple[RowSlice, ...]
    col_start: int
    cols: int
    experts: int
    grid: ScaleGrid
    col_stride: int = 0  # tensor parallel over the columns: one rank's slice starts this far from the next's

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def part_scale_rows(self, p: RowSlice) -> tuple[int, int]:
        """(first, count) of the checkpoint scale rows part p touches."""
        g = self.grid.group_n
        first = p.start // g
        return first, (p.start + p.rows - 1) // g - first + 1

    @property
    def scale_rows(self) -> int:
        return sum(self.part_scale_rows(p)[1] for p in self.parts)

    @property
    def scale_cols(self) -> int:
        return 1 if self.grid.per_channel else -(-self.cols // self.grid.group_k)

    @cached_property
    def uniform_tile_n(self) -> int:
        """Fp8Weight.tile_n for this shard: rows where the scale row changes are each part's
        start and the block boundaries inside parts (per-channel: every row, so 1)."""
        if self.grid.per_channel:
            return 1
        g, off, changes = self.grid.group_n, 0, []
        for p in self.parts:
            changes.append(off)
            changes.extend(off + b - p.start for b in range((p.start // g + 1) * g, p.start + p.rows, g))
            off += p.rows
        return uniform_tile_rows(changes)

    def scale_row_map(self) -> torch.Tensor:
        out, off = [], 0
        for p in self.parts:
            first, count = self.part_scale_rows(p)
            out.append(torch.arange(p.start, p.start + p.rows) // self.grid.group_n - first + off)
            off += count
        return torch.cat(out).to(torch.int32)


def make_fp8(module: nn.Module, attr: str, layout: Fp8Layout, name: str = "") -> None:
    """Replace module.<attr> by an FP8 weight laid out for `layout` (see the module note).
    Made on the device the module's parameters are on (meta too)."""
    g = layout.grid
    if not g.per_channel and (layout.col_start % g.group_k or layout.col_stride % g.group_k):
        raise ModelLoadError(
            f"{name or type(module).__name__}: each tensor-parallel rank holds {layout.col_stride} of its input "
            f"columns, not a multiple of the {g.group_k}-column FP8 scale blocks; block-wise FP8 needs every "
            f"rank's input slice to start a block ((input features / tp) % {g.group_k} == 0): use a smaller --tp" +
            (" or expert parallelism (--ep)" if layout.experts else ""))
    old = getattr(module, attr)
    lead = (layout.experts,) if layout.experts else ()
    dev = old.device
    setattr(module, attr, nn.Parameter(torch.zeros(*lead, layout.rows, layout.cols, dtype=FP8_DTYPE, device=dev),
                                       requires_grad=False))
    setattr(module, f"{attr}_scale", nn.Parameter(
        torch.ones(*lead, layout.scale_rows, layout.scale_cols, dtype=torch.float32, device=dev), requires_grad=False))
    module.register_buffer(f"{attr}_scale_row", layout.scale_row_map().to(dev), persistent=False)
    if not hasattr(module, "fp8") or module.fp8 is None:
        module.fp8 = {}
    module.fp8[attr] = layout


def fp8_weight(module: nn.Module, attr: str = "weight") -> Fp8Weight | None:
    """The module's FP8 weight `attr` as kernels take it, or None (a 16-bit weight)."""
    layouts = getattr(module, "fp8", None)
    if not layouts or attr not in layouts:
        return None
    layout = layouts[attr]
    return Fp8Weight(getattr(module, attr), getattr(module, f"{attr}_scale"), getattr(module, f"{attr}_scale_row"),
                     layout.grid.group_k, layout.uniform_tile_n)


def refresh_scale_rows(module: nn.Module) -> None:
    """Recompute the scale-row maps (after the module was made on the meta device)."""
    for attr, layout in (getattr(module, "fp8", None) or {}).items():
        getattr(module, f"{attr}_scale_row").copy_(layout.scale_row_map())


@dataclass
class CheckpointFp8:
    """One checkpoint tensor in FP8 with its scales on the grid: q [N, K] (or [E, N, K]),
    scale [S, KB] (per-channel: [N, 1])."""
    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_checkpoint(cls, q: torch.Tensor, scale: torch.Tensor, grid: ScaleGrid) -> "CheckpointFp8":
        if grid.per_channel:
            return cls(q, channel_scales(scale, q.shape[-2]))
        want = (-(-q.shape[-2] // grid.group_n), -(-q.shape[-1] // grid.group_k))
        if tuple(scale.shape[-2:]) != want:
            raise ModelLoadError(f"block scales of a {list(q.shape)} weight with {grid.group_n}x{grid.group_k} "
                                 f"blocks must be {list(want)}, got {list(scale.shape)}")
        return cls(q, scale.to(torch.float32))

    @classmethod
    def quantize(cls, w: torch.Tensor, grid: ScaleGrid) -> "CheckpointFp8":
        """A 16/32-bit tensor quantized on the grid (online quantization)."""
        if grid.per_channel:
            return cls(*quantize_channel(w))
        return cls(*quantize_block(w, (grid.group_n, grid.group_k)))


def load_fp8_part(module: nn.Module, attr: str, part: int, src: CheckpointFp8, expert: int | None = None) -> None:
    """Copy this rank's shard of one checkpoint tensor (part `part` of the stacked weight,
    expert `expert` of a stack) and of its scales into module.<attr>."""
    layout: Fp8Layout = module.fp8[attr]
    p = layout.parts[part]
    g = layout.grid
    if src.q.shape[0] < p.start + p.rows or src.q.shape[1] < layout.col_start + layout.cols:
        raise ModelLoadError(f"FP8 tensor of shape {list(src.q.shape)} is smaller than the slice rows "
                             f"{p.start}+{p.rows}, columns {layout.col_start}+{layout.cols} this layer needs")
    q = src.q.narrow(0, p.start, p.rows).narrow(1, layout.col_start, layout.cols)
    first, count = layout.part_scale_rows(p)
    s = src.scale.narrow(0, first, count)
    if not g.per_channel:
        s = s.narrow(1, layout.col_start // g.group_k, layout.scale_cols)
    row0 = sum(x.rows for x in layout.parts[:part])
    srow0 = sum(layout.part_scale_rows(x)[1] for x in layout.parts[:part])
    w, sc = getattr(module, attr).data, getattr(module, f"{attr}_scale").data
    if expert is not None:
        w, sc = w[expert], sc[expert]
    w.narrow(0, row0, p.rows).copy_(q)
    sc.narrow(0, srow0, count).copy_(s)


def fill_random_fp8(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """Random FP8 weights (the dummy load format): values ~ N(0, std) as FP8 values ~ N(0, 64)
    times one scale std/64, drawn a slab at a time on the weights' device."""
    for attr in (getattr(module, "fp8", None) or {}):
        w, sc = getattr(module, attr).data, getattr(module, f"{attr}_scale").data
        slabs = w.view(-1, w.shape[-1])
        step = max(1, (1 << 26) // max(1, slabs.shape[1]))
        for i in range(0, slabs.shape[0], step):
            chunk = torch.empty(min(step, slabs.shape[0] - i), slabs.shape[1], device=w.device)
            chunk.normal_(0.0, 64.0, generator=generator)
            slabs[i:i + chunk.shape[0]].copy_(chunk.clamp(-448, 448).to(FP8_DTYPE))
        sc.fill_(std / 64.0)
