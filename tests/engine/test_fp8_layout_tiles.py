"""Fp8Layout.uniform_tile_n (shared/engine/quantization/fp8_params.py), which lets the W8A8
GEMM read one weight scale per N tile instead of one a column: checked against the layout's
own scale-row map, row by row. A tile_n too wide would apply one block's scale to the next
block's rows (wrong outputs); too narrow only costs speed."""

import pytest

from shared.engine.quantization.fp8_params import Fp8Layout, RowSlice, ScaleGrid


def _tiles_constant(rows: list[int], tile: int) -> bool:
    return all(len(set(rows[i:i + tile])) == 1 for i in range(0, len(rows), tile))


@pytest.mark.parametrize("parts,block,want", [
    ([(0, 4096), (0, 1024), (0, 1024)], 128, 128),  # Qwen3-8B q/k/v, whole blocks
    ([(0, 24576)], 128, 128),  # one part of many blocks
    ([(0, 100)], 128, 256),  # a single partial block: nothing changes inside
    ([(0, 2048), (0, 64), (0, 64)], 128, 64),  # one KV head of 64 rows: parts start mid-block
    ([(20, 100), (0, 40)], 32, 4),  # a shard starting inside a block: boundaries at 12, 44, 76, 100
    ([(0, 96), (0, 96)], 32, 32),
])
def test_uniform_tile_n_is_the_widest_tile_the_scale_rows_allow(parts, block, want):
    layout = Fp8Layout(tuple(RowSlice(s, n) for s, n in parts), 0, 256, 0, ScaleGrid(block, 128))
    rows = layout.scale_row_map().tolist()
    tile = layout.uniform_tile_n
    assert tile == want
    assert _tiles_constant(rows, tile)
    if tile < 256:
        assert not _tiles_constant(rows, 2 * tile)


def test_per_channel_scales_change_every_row():
    layout = Fp8Layout((RowSlice(0, 64),), 0, 256, 0, ScaleGrid.of(None))
    assert layout.uniform_tile_n == 1
