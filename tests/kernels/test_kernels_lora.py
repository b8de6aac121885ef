"""Batched LoRA (kernels/lora.py): the Triton shrink and expand against their torch references
over batches that mix base rows (slot -1) and several adapters, stacked parts of unequal width
(a fused q/k/v), ranks below the padded tile, an output that is a column slice of a wider
buffer; and the references against the merged-weight formula W + scale * B A in float64."""

import pytest
import torch

from kernels.lora import lora_expand_reference, lora_shrink_reference
from tests.helpers.accuracy import relative_error
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

SHRINK = "kernels.lora:lora_shrink"
EXPAND = "kernels.lora:lora_expand"


def _case(rows, k, parts, rank, slots, dtype, device, seed_extra=()):
    g = case_generator(rows, k, tuple(parts), rank, slots, *seed_extra)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    a = (torch.randn(slots, len(parts), rank, k, generator=g) / k ** 0.5).to(device, dtype)
    b = (torch.randn(slots, sum(parts), rank, generator=g) / rank ** 0.5).to(device, dtype)
    # every slot, the base (-1), and runs of one slot as a prefill chunk makes them
    row_slots = torch.randint(-1, slots, (rows,), generator=g, dtype=torch.int32)
    row_slots[: rows // 3] = slots - 1
    scales = torch.rand(slots, generator=g).to(device, torch.float32) + 0.5
    starts = [0]
    for n in parts:
        starts.append(starts[-1] + n)
    return x, a, b, row_slots.to(device), scales, starts


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("rows,k,parts,rank,slots", [
    (1, 64, [48], 16, 1),             # one decode row, one part
    (5, 96, [64, 32, 32], 8, 3),      # q/k/v of unequal width, rank 8 padded to the 16 tile
    (70, 200, [100, 100], 64, 4),     # gate/up, more rows than one block, K not a block multiple
    (130, 64, [80], 32, 2),           # a prefill-sized step
    (3, 1100, [40, 24], 16, 2),       # decode rows: K in two splits, the last one short
])
def test_triton_matches_reference(runner, dtype, rows, k, parts, rank, slots):
    x, a, b, row_slots, scales, starts = _case(rows, k, parts, rank, slots, dtype, runner.device)
    partials = runner(SHRINK, x, a, row_slots)  # float32 partial sums over splits of K
    want_shrunk = lora_shrink_reference(x, a, row_slots)
    used = row_slots >= 0
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert partials.dtype == torch.float32 and partials.shape[1:] == want_shrunk.shape
    assert relative_error(partials.sum(0)[used], want_shrunk[used].float()) < tol
    y_split = torch.zeros(rows, starts[-1], dtype=dtype, device=runner.device)
    runner(EXPAND, partials, b, y_split, row_slots, scales, starts)  # the expand sums the partials itself
    want_split = lora_expand_reference(want_shrunk, b, torch.zeros_like(y_split), row_slots, scales, starts)
    assert relative_error(y_split, want_split) < tol
    base = torch.randn(rows, starts[-1], generator=case_generator("y", rows)).to(runner.device, dtype)
    y = base.clone()
    runner(EXPAND, want_shrunk, b, y, row_slots, scales, starts)
    want = lora_expand_reference(want_shrunk, b, base.clone(), row_slots, scales, starts)
    assert torch.equal(y[~used], base[~used]), "a base row changed"
    assert relative_error(y, want) < tol


def test_expand_into_a_column_slice_of_a_wider_output(runner):
    """y may be a view (the part of a fused output past other columns): only its columns change."""
    x, a, b, row_slots, scales, starts = _case(9, 64, [32, 16], 8, 2, torch.float32, runner.device)
    shrunk = lora_shrink_reference(x, a, row_slots)
    wide = torch.randn(9, 100, generator=case_generator("wide")).to(runner.device)
    before = wide.clone()
    runner(EXPAND, shrunk, b, wide[:, 20:68], row_slots, scales, starts)
    want = lora_expand_reference(shrunk, b, before[:, 20:68].clone(), row_slots, scales, starts)
    assert relative_error(wide[:, 20:68], want) < 1e-5
    assert torch.equal(wide[:, :20], before[:, :20]) and torch.equal(wide[:, 68:], before[:, 68:])


def test_no_adapter_rows_leave_the_output_alone(runner):
    x, a, b, _, scales, starts = _case(6, 64, [32], 16, 2, torch.float32, runner.device)
    base_rows = torch.full((6,), -1, dtype=torch.int32, device=runner.device)
    y = torch.randn(6, 32, generator=case_generator("none")).to(runner.device)
    before = y.clone()
    shrunk = torch.zeros(6, 1, 16, device=runner.device)
    runner(EXPAND, shrunk, b, y, base_rows, scales, starts)
    assert torch.equal(y, before)


def test_references_equal_the_merged_weight_in_float64():
    """What PEFT's merge computes: x (W + scale B A)^T, per row with that row's adapter."""
    x, a, b, row_slots, scales, starts = _case(11, 40, [24, 8, 8], 4, 3, torch.float64, "cpu")
    w = torch.randn(40, 40, dtype=torch.float64, generator=case_generator("w"))[:40]
    w = w[:starts[-1]]
    y = x @ w.t()
    got = lora_expand_reference(lora_shrink_reference(x, a, row_slots), b, y.clone(), row_slots, scales, starts)
    for t in range(x.shape[0]):
        s = int(row_slots[t])
        merged = w.clone()
        if s >= 0:
            for p in range(3):
                lo, hi = starts[p], starts[p + 1]
                merged[lo:hi] += scales[s].double() * (b[s, lo:hi] @ a[s, p])
        assert relative_error(got[t], x[t] @ merged.t()) < 1e-12


def test_shapes_are_checked():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="one slot per row"):
        lora_shrink_reference(x, torch.zeros(1, 1, 4, 8), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="input width"):
        lora_shrink_reference(x, torch.zeros(1, 1, 4, 9), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="part_starts"):
        lora_expand_reference(torch.zeros(3, 2, 4), torch.zeros(1, 10, 4), torch.zeros(3, 10),
                              torch.zeros(3, dtype=torch.int32), torch.ones(1), [0, 4, 9])
