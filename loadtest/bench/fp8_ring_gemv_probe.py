"""Does a shared-memory ring of TMA copies close the one-row FP8 linears' gap? (needs CUDA, Hopper)

The chain of an 8B layer's four FP8 linears at one row (qkv -> o -> gate/up + SwiGLU -> down, as in
loadtest/bench/persistent_chain_probe.py) over distinct layers (past L2), through CUDA graphs:
the engine's kernels (small-batch W8A16 GEMVs, PDL) against the ring GEMV below, for each tiling
given. Prints each chain's us a layer against the layer's floor at copy speed, each linear alone,
and how far layer 0's outputs lie from the fp32 chain of the dequantized weights.

The ring GEMV (Gluon, Triton >= 3.6 on Hopper): the Triton GEMVs keep bytes in flight through many
small resident programs holding their tiles in registers, and Triton's pipeliner does not stage
loads that feed no `tl.dot` (kernels/NOTES.md, "One kernel a layer"). Here a few programs an SM
each issue TMA copies of their weight tiles into a STAGES-deep ring of shared memory (an mbarrier
a slot) and refill a slot once every warp has read it; with programmatic dependent launch the ring
is filled before the wait on the previous kernel, since weights never depend on it. Work units are
(row tile, K chunk); where there are fewer row tiles than programs, K is split and the chunks meet
in fp32 partial sums (the last chunk to arrive finishes the tile and zeroes the partials). Math:
the small-batch GEMV's W8A16, y[n] = sum_k w[n, k] * scale[row(n), k // 128] * x[k] in fp32;
gate/up: silu(gate) * up, the up rows N below the gate rows; a row tile shares one scale row.
`--persistent` runs the chain as one cooperative kernel a layer instead: the four linears are
phases behind grid barriers, each phase's first ring slots filled before the barrier before it, and
a step may span several TMA boxes along K (fewer waits and barriers for the same bytes). The two
kernels keep their own loops (split K in one, boxes a step in the other): they are what was
measured (kernels/NOTES.md, "A shared-memory ring for the one-row FP8 linears").

    python3 -m loadtest.bench.fp8_ring_gemv_probe [--layers 8] [--tilings 32x256x4x8x2,...] [--no-pdl]
        [--persistent 8x256x4x2x6,16x256x4x4x3]   (the chain as one cooperative ring kernel a layer)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from .persistent_chain_probe import (
    HIDDEN,
    INTER,
    QKV,
    _dims,
    phase_errors,
    reference_layer,
)

try:  # Gluon ships with Triton >= 3.5; without it (or without Hopper) nothing here is used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # renamed after Triton 3.6 (async_copy_global_to_shared -> async_load, thread_barrier -> barrier)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
except ImportError:  # pragma: no cover - exercised only on an old Triton
    gluon = None


if gluon is not None:
    @gluon.jit
    def _pdl_enter():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _tile_scale_rows(scale_row_ptr, t, N, BLOCK_N: gl.constexpr, KB: gl.constexpr, GATE_UP: gl.constexpr):
        """Weight tile t's first scale element, and its up half's (N rows further; gate/up only)."""
        srow = gl.load(scale_row_ptr + t * BLOCK_N) * KB
        srow_u = srow
        if GATE_UP:
            srow_u = gl.load(scale_row_ptr + t * BLOCK_N + N) * KB
        return srow, srow_u

    @gluon.jit
    def _issue(w_desc, ring, ring_u, bars, i, total, pid, P, N, STEPS: gl.constexpr, SPLIT: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GATE_UP: gl.constexpr):
        """TMA copy of the program's step i (if i < total) into slot i % STAGES. The program's
        units are pid, pid + P, ...; unit u is row tile u // SPLIT, K chunk u % SPLIT."""
        s = i % STAGES
        u = pid + (i // STEPS) * P
        t = u // SPLIT
        k0 = ((u % SPLIT) * STEPS + i % STEPS) * BLOCK_K
        pred = i < total
        bar = bars.index(s)
        if GATE_UP:
            mbarrier.expect(bar, 2 * BLOCK_N * BLOCK_K, pred=pred)
            _tma_load(w_desc, [t * BLOCK_N, k0], bar, ring.index(s), pred=pred)
            _tma_load(w_desc, [t * BLOCK_N + N, k0], bar, ring_u.index(s), pred=pred)
        else:
            mbarrier.expect(bar, BLOCK_N * BLOCK_K, pred=pred)
            _tma_load(w_desc, [t * BLOCK_N, k0], bar, ring.index(s), pred=pred)

    @gluon.jit
    def fp8_ring_gemv_kernel(w_desc, scale_ptr, scale_row_ptr, x_ptr, y_ptr, part_ptr, count_ptr, N,
                             K: gl.constexpr, KB: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                             SPLIT: gl.constexpr, STAGES: gl.constexpr, GATE_UP: gl.constexpr,
                             PDL: gl.constexpr, VEC: gl.constexpr, TPW_N: gl.constexpr):
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        STEPS: gl.constexpr = K // BLOCK_K // SPLIT  # K steps a unit
        NW: gl.constexpr = gl.num_warps()
        my_units = (N // BLOCK_N * SPLIT - pid + P - 1) // P
        total = my_units * STEPS

        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        if GATE_UP:
            ring_u = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        else:
            ring_u = ring
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        # the weights never depend on the previous kernel: fill the ring before waiting for it
        for j in gl.static_range(STAGES):
            _issue(w_desc, ring, ring_u, bars, j, total, pid, P, N, STEPS, SPLIT, BLOCK_N, BLOCK_K, STAGES, GATE_UP)
        if PDL:
            _pdl_enter()

        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [TPW_N, 32 // TPW_N], [NW, 1], [1, 0])
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, layout)
        offs_k = gl.arange(0, BLOCK_K, layout=cols_l)
        offs_n = gl.arange(0, BLOCK_N, layout=rows_l)
        i = 0
        for uu in range(my_units):
            u = pid + uu * P
            t = u // SPLIT
            kbase = (u % SPLIT) * STEPS * BLOCK_K
            srow, srow_u = _tile_scale_rows(scale_row_ptr, t, N, BLOCK_N, KB, GATE_UP)
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            acc_u = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            for ks in range(STEPS):
                kk = kbase + ks * BLOCK_K + offs_k
                xk = gl.load(x_ptr + kk).to(gl.float32)
                xs = xk * gl.load(scale_ptr + srow + kk // 128)
                s = i % STAGES
                mbarrier.wait(bars.index(s), (i // STAGES) & 1)
                w = ring.index(s).load(layout).to(gl.float32)
                acc += w * gl.expand_dims(xs, 0)
                if GATE_UP:
                    xu = xk * gl.load(scale_ptr + srow_u + kk // 128)
                    uw = ring_u.index(s).load(layout).to(gl.float32)
                    acc_u += uw * gl.expand_dims(xu, 0)
                _cta_barrier()  # every warp has read slot s before the copy that refills it
                _issue(w_desc, ring, ring_u, bars, i + STAGES, total, pid, P, N, STEPS, SPLIT, BLOCK_N, BLOCK_K,
                       STAGES, GATE_UP)
                i += 1
            out = gl.sum(acc, axis=1)
            up = gl.sum(acc_u, axis=1)
            rows = t * BLOCK_N + offs_n
            if SPLIT > 1:
                # K chunks meet in fp32 partial sums; the tile's last chunk to arrive finishes the
                # tile and leaves the partials and its counter at zero for the next launch
                gl.atomic_add(part_ptr + rows, out, sem="relaxed")
                if GATE_UP:
                    gl.atomic_add(part_ptr + N + rows, up, sem="relaxed")
                _cta_barrier()
                seen = gl.atomic_add(count_ptr + t, 1, sem="acq_rel")
                if seen == SPLIT - 1:
                    out = gl.atomic_xchg(part_ptr + rows, gl.zeros_like(out))
                    if GATE_UP:
                        up = gl.atomic_xchg(part_ptr + N + rows, gl.zeros_like(up))
                        out = out / (1.0 + gl.exp(-out)) * up
                    gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))
                    gl.atomic_xchg(count_ptr + t, 0)
            else:
                if GATE_UP:
                    out = out / (1.0 + gl.exp(-out)) * up
                gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))

    # -- the whole chain as one persistent kernel: phases behind grid barriers, each phase's
    # first STAGES tiles issued before the barrier that precedes it (weights need no data)
    @gluon.jit
    def _grid_sync(bar, P):
        """Every program arrives before any leaves (the counter only grows: a program's target is
        the next multiple of P above its arrival)."""
        _cta_barrier()
        old = gl.atomic_add(bar, 1, sem="acq_rel", scope="gpu")
        target = (old // P + 1) * P
        seen = old + 1
        while seen < target:
            seen = gl.atomic_add(bar, 0, sem="acquire", scope="gpu")
        _cta_barrier()

    @gluon.jit
    def _issue_at(w_desc, ring, ring_u, bars, g, step, total, pid, P, N, KSTEPS: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SUB: gl.constexpr, STAGES: gl.constexpr,
                  GATE_UP: gl.constexpr):
        """The copies of the phase's step `step` (if < total; SUB boxes along K) into the slot of
        global step g: g counts consumed steps over all phases, so every slot's barrier completes
        in order."""
        s = g % STAGES
        t = pid + (step // KSTEPS) * P
        k0 = (step % KSTEPS) * BLOCK_K * SUB
        pred = step < total
        bar = bars.index(s)
        if GATE_UP:
            mbarrier.expect(bar, 2 * SUB * BLOCK_N * BLOCK_K, pred=pred)
        else:
            mbarrier.expect(bar, SUB * BLOCK_N * BLOCK_K, pred=pred)
        for j in gl.static_range(SUB):
            _tma_load(w_desc, [t * BLOCK_N, k0 + j * BLOCK_K], bar, ring.index(s * SUB + j),
                                            pred=pred)
            if GATE_UP:
                _tma_load(w_desc, [t * BLOCK_N + N, k0 + j * BLOCK_K], bar,
                                                ring_u.index(s * SUB + j), pred=pred)

    @gluon.jit
    def _prologue(w_desc, ring, ring_u, bars, g, pid, P, N, K: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, SUB: gl.constexpr, STAGES: gl.constexpr, GATE_UP: gl.constexpr):
        KSTEPS: gl.constexpr = K // (BLOCK_K * SUB)
        total = (N // BLOCK_N - pid + P - 1) // P * KSTEPS
        for j in gl.static_range(STAGES):
            _issue_at(w_desc, ring, ring_u, bars, g + j, j, total, pid, P, N, KSTEPS, BLOCK_N, BLOCK_K, SUB,
                      STAGES, GATE_UP)

    @gluon.jit
    def _ring_phase(w_desc, scale_ptr, scale_row_ptr, x_ptr, y_ptr, ring, ring_u, bars, g, pid, P, N,
                    K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SUB: gl.constexpr,
                    STAGES: gl.constexpr, GATE_UP: gl.constexpr, VEC: gl.constexpr, TPW_N: gl.constexpr):
        """One linear over the program's row tiles (whole K each), its prologue already issued;
        returns the global step count after it."""
        KSTEPS: gl.constexpr = K // (BLOCK_K * SUB)
        KB: gl.constexpr = K // 128
        NW: gl.constexpr = gl.num_warps()
        my_tiles = (N // BLOCK_N - pid + P - 1) // P
        total = my_tiles * KSTEPS
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [TPW_N, 32 // TPW_N], [NW, 1], [1, 0])
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        step = 0
        for tt in range(my_tiles):
            t = pid + tt * P
            srow, srow_u = _tile_scale_rows(scale_row_ptr, t, N, BLOCK_N, KB, GATE_UP)
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            acc_u = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            for ks in range(KSTEPS):
                s = g % STAGES
                mbarrier.wait(bars.index(s), (g // STAGES) & 1)
                for j in gl.static_range(SUB):
                    kk = (ks * SUB + j) * BLOCK_K + offs_k
                    xk = gl.load(x_ptr + kk).to(gl.float32)
                    w = ring.index(s * SUB + j).load(layout).to(gl.float32)
                    acc += w * gl.expand_dims(xk * gl.load(scale_ptr + srow + kk // 128), 0)
                    if GATE_UP:
                        uw = ring_u.index(s * SUB + j).load(layout).to(gl.float32)
                        acc_u += uw * gl.expand_dims(xk * gl.load(scale_ptr + srow_u + kk // 128), 0)
                _cta_barrier()  # every warp has read slot s before the copy that refills it
                _issue_at(w_desc, ring, ring_u, bars, g + STAGES, step + STAGES, total, pid, P, N, KSTEPS,
                          BLOCK_N, BLOCK_K, SUB, STAGES, GATE_UP)
                g += 1
                step += 1
            out = gl.sum(acc, axis=1)
            if GATE_UP:
                up = gl.sum(acc_u, axis=1)
                out = out / (1.0 + gl.exp(-out)) * up
            gl.store(y_ptr + t * BLOCK_N + offs_n, out.to(y_ptr.dtype.element_ty))
        return g

    @gluon.jit
    def ring_chain_kernel(x_ptr, dq, sq, rq, yq, do, so, ro, yo, dg, sg, rg, yg, dd, sd, rd, yd, bar,
                          HIDDEN: gl.constexpr, INTER: gl.constexpr, QKV: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, SUB: gl.constexpr, STAGES: gl.constexpr, VEC: gl.constexpr,
                          TPW_N: gl.constexpr):
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        ring = gl.allocate_shared_memory(dq.dtype, [STAGES * SUB, BLOCK_N, BLOCK_K], dq.layout)
        ring_u = gl.allocate_shared_memory(dq.dtype, [STAGES * SUB, BLOCK_N, BLOCK_K], dq.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        g = 0
        _prologue(dq, ring, ring_u, bars, g, pid, P, QKV, HIDDEN, BLOCK_N, BLOCK_K, SUB, STAGES, False)
        g = _ring_phase(dq, sq, rq, x_ptr, yq, ring, ring_u, bars, g, pid, P, QKV, HIDDEN, BLOCK_N, BLOCK_K, SUB,
                        STAGES, False, VEC, TPW_N)
        _prologue(do, ring, ring_u, bars, g, pid, P, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K, SUB, STAGES, False)
        _grid_sync(bar, P)
        g = _ring_phase(do, so, ro, yq, yo, ring, ring_u, bars, g, pid, P, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K, SUB,
                        STAGES, False, VEC, TPW_N)
        _prologue(dg, ring, ring_u, bars, g, pid, P, INTER, HIDDEN, BLOCK_N, BLOCK_K, SUB, STAGES, True)
        _grid_sync(bar, P)
        g = _ring_phase(dg, sg, rg, yo, yg, ring, ring_u, bars, g, pid, P, INTER, HIDDEN, BLOCK_N, BLOCK_K, SUB,
                        STAGES, True, VEC, TPW_N)
        _prologue(dd, ring, ring_u, bars, g, pid, P, HIDDEN, INTER, BLOCK_N, BLOCK_K, SUB, STAGES, False)
        _grid_sync(bar, P)
        g = _ring_phase(dd, sd, rd, yg, yd, ring, ring_u, bars, g, pid, P, HIDDEN, INTER, BLOCK_N, BLOCK_K, SUB,
                        STAGES, False, VEC, TPW_N)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))


def ring_layout_params(block_n: int, block_k: int, warps: int) -> tuple[int, int]:
    """(values a thread reads at once along K, threads of a warp along N) for a [block_n,
    block_k] FP8 tile: 16-byte reads, a warp spanning as much of K as the tile allows."""
    vec = min(16, block_k)
    tpw_k = min(32, block_k // vec)
    return vec, 32 // tpw_k


def ring_split(tiles: int, ksteps: int, programs: int) -> int:
    """K chunks a row tile splits into: the fewest (a power of two dividing the K steps) that
    give every program a unit."""
    split = 1
    while tiles * split < programs and ksteps % (2 * split) == 0:
        split *= 2
    return split


@dataclass
class RingWorkspace:
    """fp32 partial sums and per-tile arrival counters for split-K launches; every launch leaves
    them at zero. One a stream: launches on one stream never overlap."""
    part: torch.Tensor
    count: torch.Tensor

    @classmethod
    def create(cls, device, rows: int = 1 << 16) -> RingWorkspace:
        return cls(torch.zeros(rows, dtype=torch.float32, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device))


def fp8_ring_gemv(x: torch.Tensor, w, *, gate_up: bool = False, block_n: int = 32, block_k: int = 128,
                  stages: int = 8, warps: int = 4, programs: int | None = None, split: int | None = None,
                  pdl: bool = False, out: torch.Tensor | None = None, desc=None,
                  workspace: RingWorkspace | None = None) -> torch.Tensor:
    """y = x @ W^T for one row x [K] (bf16) and an FP8 weight w (kernels/fp8.py Fp8Weight);
    gate_up: silu(x @ G^T) * (x @ U^T) from the stacked [2N, K] weight. desc: a descriptor made
    by ring_descriptor() for this weight and tile (made here if None)."""
    rows, k = w.q.shape
    n = rows // 2 if gate_up else rows
    assert x.numel() == k and k % block_k == 0 and n % block_n == 0, (x.shape, w.q.shape, block_n, block_k)
    assert w.group_k == 128 and (w.tile_n == 0 or w.tile_n >= block_n), "tiles must share one scale row"
    if desc is None:
        desc = ring_descriptor(w, block_n, block_k)
    y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = n // block_n
    if split is None:
        split = ring_split(tiles, k // block_k, programs)
    if split > 1:
        assert workspace is not None and workspace.part.numel() >= rows and workspace.count.numel() >= tiles
    ws = workspace or RingWorkspace(y, y)  # unused without a split
    programs = min(programs, tiles * split)
    vec, tpw_n = ring_layout_params(block_n, block_k, warps)
    fp8_ring_gemv_kernel[(programs,)](
        desc, w.scale, w.scale_row, x.view(-1), y, ws.part, ws.count, n, K=k, KB=w.scale.shape[-1],
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, STAGES=stages, GATE_UP=gate_up, PDL=pdl, VEC=vec,
        TPW_N=tpw_n, num_warps=warps, launch_pdl=pdl)
    return y


def ring_descriptor(w, block_n: int, block_k: int):
    """The TMA descriptor of w's FP8 values in [block_n, block_k] boxes."""
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    return TensorDescriptor.from_tensor(w.q, [block_n, block_k], layout)


KINDS = ("qkv", "o", "gu", "d")


def ring_chain(layers, x0, tiling, pdl: bool):
    """The chain by the ring kernel; returns (run, layer 0's outputs of the last run)."""
    bn, bk, stages, warps, per_sm = tiling
    descs = [{k: ring_descriptor(lw[k], bn, bk) for k in KINDS} for lw in layers]
    dev = x0.device
    bufs = [{"qkv": torch.empty(QKV, dtype=torch.bfloat16, device=dev),
             "o": torch.empty(HIDDEN, dtype=torch.bfloat16, device=dev),
             "gu": torch.empty(INTER, dtype=torch.bfloat16, device=dev),
             "d": torch.empty(HIDDEN, dtype=torch.bfloat16, device=dev)} for _ in layers]
    kw = {"block_n": bn, "block_k": bk, "stages": stages, "warps": warps, "pdl": pdl,
          "programs": _sms(dev) * per_sm, "workspace": RingWorkspace.create(dev)}

    def run():
        x = x0.view(-1)
        for lw, d, b in zip(layers, descs, bufs):
            fp8_ring_gemv(x, lw["qkv"], out=b["qkv"], desc=d["qkv"], **kw)
            fp8_ring_gemv(b["qkv"][:HIDDEN], lw["o"], out=b["o"], desc=d["o"], **kw)
            fp8_ring_gemv(b["o"], lw["gu"], gate_up=True, out=b["gu"], desc=d["gu"], **kw)
            fp8_ring_gemv(b["gu"], lw["d"], out=b["d"], desc=d["d"], **kw)
            x = b["d"]
        return x
    return run, bufs[0]


def persistent_ring_chain(layers, x0, tiling):
    """The chain as one cooperative ring kernel a layer; returns (run, layer 0's outputs), the
    outputs NaN-poisoned first (a phase that read before its barrier would show)."""
    bn, bk, stages, warps, per_sm, sub = (*tiling, 1)[:6]
    dev = x0.device
    qkv, hidden, inter = _dims(layers[0])
    descs = [{k: ring_descriptor(lw[k], bn, bk) for k in KINDS} for lw in layers]
    nan = float("nan")
    bufs = [{k: torch.full((n,), nan, dtype=torch.bfloat16, device=dev)
             for k, n in (("qkv", qkv), ("o", hidden), ("gu", inter), ("d", hidden))} for _ in layers]
    bar = torch.zeros(1, dtype=torch.int64, device=dev)
    vec, tpw_n = ring_layout_params(bn, bk, warps)
    programs = _sms(dev) * per_sm

    def run():
        x = x0.view(-1)
        for lw, d, b in zip(layers, descs, bufs):
            args = [x]
            for k in KINDS:
                args += [d[k], lw[k].scale, lw[k].scale_row, b[k]]
            ring_chain_kernel[(programs,)](*args, bar, HIDDEN=hidden, INTER=inter, QKV=qkv, BLOCK_N=bn,
                                           BLOCK_K=bk, SUB=sub, STAGES=stages, VEC=vec, TPW_N=tpw_n,
                                           num_warps=warps, launch_cooperative_grid=True)
            x = b["d"]
        return x
    return run, bufs[0]


def one_kind(layers, kind, x_by_kind, tiling, pdl, engine, ws):
    """Only one linear of each layer (the same input each time): its time alone."""
    from kernels.fp8_linear import fp8_gate_up_silu, fp8_linear

    x = x_by_kind[kind]
    if engine:
        fn = fp8_gate_up_silu if kind == "gu" else fp8_linear
        return lambda: [fn(x.view(1, -1), lw[kind], workspace=ws, pdl=pdl) for lw in layers]
    bn, bk, stages, warps, per_sm = tiling
    descs = [ring_descriptor(lw[kind], bn, bk) for lw in layers]
    n = {"qkv": QKV, "o": HIDDEN, "gu": INTER, "d": HIDDEN}[kind]
    out = torch.empty(n, dtype=torch.bfloat16, device=x.device)
    rws = RingWorkspace.create(x.device)
    return lambda: [fp8_ring_gemv(x, lw[kind], gate_up=kind == "gu", out=out, desc=d, block_n=bn, block_k=bk,
                                  stages=stages, warps=warps, pdl=pdl, programs=_sms(x.device) * per_sm,
                                  workspace=rws)
                  for lw, d in zip(layers, descs)]


def _sms(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="distinct layers' weights in a replay (past L2)")
    p.add_argument("--tilings", default="32x256x4x4x3,16x256x4x4x4,32x256x3x4x4,32x128x6x4x3,32x256x4x8x2,"
                   "64x256x3x4x3,32x256x6x4x2,16x256x6x4x3",
                   help="BLOCK_N x BLOCK_K x STAGES x warps x programs an SM of the ring kernel")
    p.add_argument("--persistent", default="",
                   help="tilings (as --tilings, and optionally x boxes along K a step) of the whole chain as "
                   "one persistent ring kernel a layer")
    p.add_argument("--no-pdl", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from kernels.pdl import Pdl, pdl_supported
    from kernels.small_batch_linear import SmallBatchWorkspace
    from loadtest.bench.persistent_chain_probe import (
        ChainSetup,
        separate_chain,
        separate_layer,
    )
    from loadtest.bench.small_batch_linear import graph_replay_ms

    say = lambda s: print(s, flush=True)
    setup = ChainSetup.create(args.layers, say)
    dev, layers, x0, floor_us = setup.dev, setup.layers, setup.x0, setup.floor_us
    pdl = None if args.no_pdl else (Pdl() if pdl_supported(dev) else None)
    ws = SmallBatchWorkspace.create(dev)
    ref0 = reference_layer(x0.view(-1), layers[0])
    x_by_kind = {"qkv": x0.view(-1), "o": ref0["qkv"][:HIDDEN].contiguous(), "gu": ref0["o"], "d": ref0["gu"]}
    kind_bytes = {"qkv": QKV * HIDDEN, "o": HIDDEN * HIDDEN, "gu": 2 * INTER * HIDDEN, "d": HIDDEN * INTER}

    rows = []
    err = max(phase_errors(separate_layer(layers[0], x0, pdl, ws), ref0).values())
    us = graph_replay_ms([separate_chain(layers, x0, pdl, ws)], 10) * 1e3 / args.layers
    alone = {k: graph_replay_ms([one_kind(layers, k, x_by_kind, None, pdl, True, ws)], 10) * 1e3 / args.layers
             for k in KINDS}
    rows.append(("engine kernels (small-batch W8A16, PDL)", us, err, alone))
    say(f"engine: {us:.1f} us a layer, alone {alone}, err {err:.1e}")
    for spec in args.tilings.split(","):
        tiling = tuple(int(v) for v in spec.split("x"))
        label = "ring bn{} bk{} stages{} w{} {}/SM".format(*tiling)
        try:
            run, out0 = ring_chain(layers, x0, tiling, pdl is not None)
            run()
            torch.cuda.synchronize()
            err = max(phase_errors(out0, ref0).values())
            us = graph_replay_ms([run], 10) * 1e3 / args.layers
            alone = {k: graph_replay_ms([one_kind(layers, k, x_by_kind, tiling, pdl is not None, False, ws)], 10)
                     * 1e3 / args.layers for k in KINDS}
        except Exception as e:  # noqa: BLE001 - a tiling that fails is reported, the rest run
            say(f"{label}: failed {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append((label, us, err, alone))
        say(f"{label}: {us:.1f} us a layer, alone {alone}, err {err:.1e}")
    for spec in filter(None, args.persistent.split(",")):
        tiling = tuple(int(v) for v in spec.split("x"))
        label = "persistent ring bn{} bk{} stages{} w{} {}/SM x{} boxes a step".format(*(*tiling, 1)[:6])
        try:
            run, out0 = persistent_ring_chain(layers, x0, tiling)
            run()
            torch.cuda.synchronize()
            err = max(phase_errors(out0, ref0).values())
            us = graph_replay_ms([run], 10) * 1e3 / args.layers
        except Exception as e:  # noqa: BLE001 - a tiling that fails is reported, the rest run
            say(f"{label}: failed {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append((label, us, err, None))
        say(f"{label}: {us:.1f} us a layer, err {err:.1e}")
    say("")
    say(f"| one-row FP8 chain ({args.layers} layers, pdl {pdl is not None}) | us a layer | x floor ({floor_us:.1f}) "
        "| qkv / o / gate-up / down alone, us (GB/s) | layer 0 vs fp32, max rel err |")
    say("|---|---|---|---|---|")
    for label, us, err, alone in rows:
        parts = " / ".join(f"{alone[k]:.1f} ({kind_bytes[k] / alone[k] / 1e3:.0f})" for k in KINDS) if alone else "-"
        say(f"| {label} | {us:.1f} | {us / floor_us:.2f} | {parts} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
