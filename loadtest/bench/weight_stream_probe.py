"""How fast a kernel can stream a decode step's FP8 weight bytes, by how they lie in memory
(needs CUDA). A one-row FP8 GEMV is a read of its weights; the small-batch kernel's best
tilings read them at 67-96% of a device copy's pace (loadtest/bench/small_batch_linear.py), and
a kernel that only sums the raw bytes in the same tiles is no faster (fp8_gemv_probe's "bytes").
This probe asks whether the layout is the limit: the same bytes summed (integers, no float
work) by

  rows    [BLOCK_N, BLOCK_K] tiles of the row-major [N, K] weight, as the GEMV reads it now:
          each tile row a BLOCK_K-byte run, rows K bytes apart
  tiles   the same tiles stored one after another (a tile-major copy made at load time, as
          Marlin-style kernels repack weights): each step reads BLOCK_N * BLOCK_K contiguous
          bytes, each program one contiguous run
  flat    the buffer cut into equal contiguous chunks, one per program: a pure streaming read

and a device-to-device copy beside them (read + write, the figure the benches call copy
speed). Weights past L2 (CUDA graphs over distinct copies, >= 200 MiB a replay).

    python3 -m loadtest.bench.weight_stream_probe [--shapes gate_up,down,qkv,o]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.language as tl

# Qwen3-8B's decode linears (gate/up stacked: the fused kernel reads both halves)
SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096), "o": (4096, 4096)}
TILINGS = ((16, 512, 4), (32, 256, 4), (32, 256, 8), (32, 512, 8), (64, 256, 8), (16, 1024, 8))
FLAT = ((8192, 4), (16384, 8), (32768, 8))  # bytes a step, warps
MIN_BYTES = 200 << 20


@triton.jit
def _rows_kernel(w_ptr, out_ptr, N, K, k_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    k_start = tl.program_id(1) * k_per_split
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):  # the last split may be short
        acc += tl.load(w_ptr + rows[:, None] * K + (k0 + rk)[None, :]).to(tl.int32)
    tl.atomic_add(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _tiles_kernel(w_ptr, out_ptr, tiles_k, k_tiles_per_split, TILE: tl.constexpr):
    first = (tl.program_id(0) * tiles_k + tl.program_id(1) * k_tiles_per_split).to(tl.int64) * TILE
    r = tl.arange(0, TILE)
    acc = tl.zeros([TILE], tl.int32)
    for i in range(0, k_tiles_per_split):
        acc += tl.load(w_ptr + first + i * TILE + r).to(tl.int32)
    tl.atomic_add(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _flat_kernel(w_ptr, out_ptr, chunk, STEP: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * chunk
    r = tl.arange(0, STEP)
    acc = tl.zeros([STEP], tl.int32)
    for i in range(0, chunk, STEP):
        acc += tl.load(w_ptr + first + i + r).to(tl.int32)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0))


def replay_us(fns, replays: int = 10) -> float:
    """Median microseconds of one call, from a CUDA graph that runs every fn once per replay."""
    from .small_batch_linear import graph_replay_ms
    return graph_replay_ms(fns, replays) * 1e3 / len(fns)


def split_for(tiles: int, k_steps: int, sms: int) -> int:
    """Splits that give every SM ~4 programs (each split >= 2 K steps), as the sweep starts."""
    return max(1, min(-(-4 * sms // tiles), k_steps // 2, 32))


def probe_shape(name: str, n: int, k: int, sms: int, say) -> list[tuple]:
    nbytes = n * k
    count = max(2, -(-MIN_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randint(0, 256, (n, k), device="cuda", dtype=torch.uint8, generator=gen) for _ in range(count)]
    out = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    rows_out = []

    def best_of(label, cases):
        best = None
        for desc, make in cases:
            try:
                us = replay_us(make())
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is skipped
                say(f"  {name} {label} {desc} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            if best is None or us < best[0]:
                best = (us, desc)
        if best is not None:
            rows_out.append((name, label, best[0], nbytes / best[0] / 1e3, best[1]))
            say(f"  {name} {label}: {best[0]:.2f} us ({best[1]})")

    def rows_case(bn, bk, warps):
        tiles, split = -(-n // bn), split_for(-(-n // bn), k // bk, sms)
        per = -(-(k // bk) // split) * bk
        grid = (tiles, -(-k // per))
        return (f"bn{bn} bk{bk} w{warps} split{grid[1]}",
                lambda: [lambda w=w: _rows_kernel[grid](w, out, n, k, per, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                        num_stages=1) for w in weights])
    best_of("rows", [rows_case(*t) for t in TILINGS if k % t[1] == 0])

    tiled: dict[tuple, list] = {}

    def tiles_case(bn, bk, warps):
        tn, tk = n // bn, k // bk
        split = split_for(tn, tk, sms)
        per = -(-tk // split)
        while tk % per:  # whole K tiles a split
            per += 1

        def make():
            if (bn, bk) not in tiled:
                tiled.clear()  # one tile-major set at a time: they are as large as the weights
                tiled[(bn, bk)] = [w.view(tn, bn, tk, bk).permute(0, 2, 1, 3).contiguous() for w in weights]
            return [lambda w=w: _tiles_kernel[(tn, tk // per)](w, out, tk, per, TILE=bn * bk, num_warps=warps,
                                                               num_stages=1) for w in tiled[(bn, bk)]]
        return f"bn{bn} bk{bk} w{warps} split{tk // per}", make
    best_of("tiles", [tiles_case(*t) for t in TILINGS if n % t[0] == 0 and k % t[1] == 0])
    tiled.clear()

    def flat_case(step, warps, programs):
        chunk = -(-nbytes // programs // step) * step
        grid = (nbytes // chunk,)  # the remainder (under one chunk) is left unread: timing only
        return (f"step{step} w{warps} programs{grid[0]}",
                lambda: [lambda w=w: _flat_kernel[grid](w, out, chunk, STEP=step, num_warps=warps, num_stages=1)
                         for w in weights])
    best_of("flat", [flat_case(s, w, p) for s, w in FLAT for p in (sms * 2, sms * 4, sms * 8)])

    dst = torch.empty_like(weights[0])
    us = replay_us([lambda w=w: dst.copy_(w) for w in weights])
    rows_out.append((name, "copy (read+write)", us, 2 * nbytes / us / 1e3, "torch copy_"))
    del weights, dst
    torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.weight_stream_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gate_up,down,qkv,o")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name(0)}, {sms} SMs, triton {triton.__version__}", flush=True)
    table = []
    for name in args.shapes.split(","):
        table += probe_shape(name, *SHAPES[name], sms, lambda line: print(line, flush=True))
    print(f"\n=== weight_stream_probe (bytes summed, weights past L2), {time.time() - t0:.0f} s ===")
    print(f"{'shape':<9}{'layout':<19}{'us':>8}{'GB/s':>7}  best")
    for name, label, us, gbs, desc in table:
        print(f"{name:<9}{label:<19}{us:8.2f}{gbs:7.0f}  {desc}")
    per_layer = {}
    for name, label, us, _, _ in table:
        per_layer[label] = per_layer.get(label, 0.0) + us
    print("a layer's four linears: " + ", ".join(f"{k} {v:.1f} us" for k, v in per_layer.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
