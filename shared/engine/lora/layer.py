"""The device side of LoRA: each adapted linear's slot buffers, and the hook its forward calls.

Every adapted linear (models/layers.py: `linear.lora`) holds A [slots, parts, rank, in] and
B [slots, out, rank] for its TP shard: a column-parallel linear (q/k/v, gate/up) its rows of
each part's B and all of A; a row-parallel one (o, down) its columns of A and all of B. The
row-parallel update is then a partial sum like the base output's, and the all-reduce that
follows (the next norm's) sums it with theirs. One LoraStep, shared by every hook, holds the
step's per-row slot index in a buffer that never moves, so captured CUDA graphs read the slots
of the step being replayed: y += scale[s] * (x A[s]^T) B[s]^T per row, slot -1 the base model."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .targets import dense_mlp


@dataclass
class LoraStep:
    """What the hooks of one forward read, set by the model runner before it (model_runner.py)."""
    row_slots: torch.Tensor  # [capacity] int32 on the device: each row's slot, -1 past the rows
    scales: torch.Tensor     # [slots] float32 on the device
    triton: bool             # the Triton kernels (GPU) or the torch references
    rows_with_adapters: bool = False  # the eager step has a row of some adapter
    # the hooks launch even with no adapter row: CUDA graphs being captured must hold the
    # launches, and warm-up compiles them for every shape
    forced: bool = False

    @property
    def active(self) -> bool:
        return self.rows_with_adapters or self.forced

    @contextmanager
    def forcing(self):
        self.forced = True
        try:
            yield
        finally:
            self.forced = False

    def set_rows(self, rows: torch.Tensor, any_adapter: bool) -> None:
        """This step's slots, one per token row (the step plan's `lora` section)."""
        n = rows.shape[0]
        if n > self.row_slots.shape[0]:
            raise ValueError(f"a step of {n} rows exceeds the LoRA row buffer ({self.row_slots.shape[0]})")
        self.row_slots[:n].copy_(rows, non_blocking=True)
        self.row_slots[n:].fill_(-1)  # padded graph rows read the base model
        self.rows_with_adapters = any_adapter


class LoraLinear:
    """One adapted linear's slots and its update."""

    def __init__(self, step: LoraStep, linear, slots: int, rank: int, dtype, device):
        self.step = step
        self.linear = linear
        self.row_parallel = not hasattr(linear, "parts")
        if self.row_parallel:
            in_local, out_parts = linear.in_shard, [linear.weight.shape[0]]
        else:
            in_local, out_parts = linear.weight.shape[1], list(linear.parts)
        self.part_starts = [0]
        for n in out_parts:
            self.part_starts.append(self.part_starts[-1] + n)
        self.a = torch.zeros(slots, len(out_parts), rank, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(slots, self.part_starts[-1], rank, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    # -- the forward --------------------------------------------------------------------------
    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (x's base output, every part's columns) plus each adapter row's update, in place."""
        if not self.step.active:
            return y
        rows = self.step.row_slots[:x.shape[0]]
        shrunk = self._shrink(x, rows)
        return self._expand(shrunk, self.b, y, rows, self.part_starts)

    def add_parts(self, x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """add() where each part's output is its own tensor (the CPU's per-part matmuls)."""
        if not self.step.active:
            return outs
        rows = self.step.row_slots[:x.shape[0]]
        shrunk = self._shrink(x, rows)
        for p, out in enumerate(outs):
            lo, hi = self.part_starts[p], self.part_starts[p + 1]
            self._expand(shrunk[..., p:p + 1, :], self.b[:, lo:hi], out, rows, [0, hi - lo])
        return outs

    def _shrink(self, x, rows):
        if self.step.triton:
            from kernels.lora import lora_shrink
            return lora_shrink(x, self.a, rows)
        from kernels.lora import lora_shrink_reference
        return lora_shrink_reference(x, self.a, rows)

    def _expand(self, shrunk, b, y, rows, starts):
        if self.step.triton:
            from kernels.lora import lora_expand
            return lora_expand(shrunk, b, y, rows, self.step.scales, starts)
        from kernels.lora import lora_expand_reference
        return lora_expand_reference(shrunk, b, y, rows, self.step.scales, starts)

    # -- loading a slot -------------------------------------------------------------------------
    def write(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` gets each part's (A [r, in], B [out, r]) over the whole model (None: that
        part is not adapted), cut to this rank's shard; ranks below the slots' are zero-padded."""
        a_slot, b_slot = self.a[slot], self.b[slot]
        a_slot.zero_()
        b_slot.zero_()
        lin = self.linear
        for p, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, lin.tp.rank * lin.in_shard, lin.in_shard)
            else:
                b = b.narrow(0, lin.starts[p], lin.parts[p])
            lo, hi = self.part_starts[p], self.part_starts[p + 1]
            a_slot[p, :r].copy_(a.to(self.a.dtype), non_blocking=True)
            b_slot[lo:hi, :r].copy_(b.to(self.b.dtype), non_blocking=True)


def attach_lora(model, cfg, step: LoraStep, slots: int, rank: int, dtype, device) -> dict[tuple[int, str], LoraLinear]:
    """Hook every adaptable linear of the model ((layer, linear name) -> its LoraLinear): q/k/v
    and o everywhere, gate/up and down where the MLP is dense."""
    hooks = {}
    for i, layer in enumerate(model.layers):
        names = ["qkv_proj", "o_proj"] + (["gate_up_proj", "down_proj"] if dense_mlp(cfg, i) else [])
        for name in names:
            block = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            linear = getattr(block, name)
            linear.lora = hooks[(i, name)] = LoraLinear(step, linear, slots, rank, dtype, device)
    return hooks
