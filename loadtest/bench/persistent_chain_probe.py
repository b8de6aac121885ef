"""Would fewer, longer kernels close a one-row FP8 decode step's gap to its floor? (needs CUDA)

At batch 1 an 8B layer's four FP8 linears (qkv, o, gate/up + SwiGLU, down) are four
bandwidth-bound GEMVs; each pays its kernel's ramp and tail (~2.5-3 us over a 2.9 TB/s
stream, kernels/NOTES.md "Decode weights as a stream"), so they take ~82 us a layer against
~65 at copy speed. This probe runs the same chain (each linear's output feeding the next, as
in a layer with attention left out) two ways over distinct weights per layer (past L2):

  separate     the engine's kernels: kernels/fp8_linear.py at one row, PDL on, as a decode
               step launches them (small-batch W8A16 GEMVs with their tuned tilings)
  persistent   one kernel a layer, one program per SM: the four linears are phases, each
               program walks its share of a phase's row tiles, and a grid-wide barrier (an
               int64 arrival counter: release on arrival, acquire while spinning) separates
               the phases; `prefetch` asks L2 for each program's first weight tiles of the
               next phase before it waits at the barrier (weights never depend on the data)

and prints us a layer, the figures against copy speed, and how far the first layer's four
outputs lie from the chain computed in fp32 from the dequantized weights (the chain itself
decays towards zero over random layers, SwiGLU being quadratic, so only the first layer is
compared). Persistent launches are cooperative: a grid that cannot be resident at once is
refused by the driver instead of spinning forever.

    python3 -m loadtest.bench.persistent_chain_probe [--layers 8] [--prefetch 0,2] [--tilings ...]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_pdl import prefetch_l2

HIDDEN, INTER, QKV = 4096, 12288, 6144  # Qwen3-8B


@triton.jit
def _grid_sync(bar, P):
    """Every program of the grid arrives before any leaves; writes before are seen after.
    The counter only grows: a program's target is the next multiple of P above its arrival."""
    tl.debug_barrier()
    old = tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu")
    target = (old // P + 1) * P
    seen = old + 1
    while seen < target:
        seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_phase(pid, P, w, N, K: tl.constexpr, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GATE_UP: tl.constexpr):
    """Ask L2 for this program's first DEPTH [BLOCK_N, BLOCK_K] weight tiles of a phase."""
    if DEPTH > 0:
        rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        lines = tl.arange(0, BLOCK_K // 128) * 128
        for i in tl.static_range(DEPTH):
            ptrs = w + rows[:, None] * K + (i * BLOCK_K + lines)[None, :]
            prefetch_l2(ptrs)
            if GATE_UP:
                prefetch_l2(ptrs + N * K)


@triton.jit
def _step_loads(w, s, x, pid, P, N, i, steps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GATE_UP: tl.constexpr):
    """What step i (clamped into the program's steps) reads: the weight tile(s), x's slice, and
    each column's scale (weights and scales from DRAM/L2, x from L2: another program wrote it)."""
    KB: tl.constexpr = K // 128
    KSTEPS: tl.constexpr = K // BLOCK_K
    j = tl.minimum(i, steps - 1)
    t = pid + (j // KSTEPS) * P
    k0 = (j % KSTEPS) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    rows = (t * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    wt = tl.load(w + rows[:, None] * K + rk[None, :])
    xt = tl.load(x + rk, cache_modifier=".cg")
    sv = tl.load(s + (t * BLOCK_N // 128) * KB + rk // 128)
    ut = wt
    su = sv
    if GATE_UP:
        ut = tl.load(w + (rows + N)[:, None] * K + rk[None, :])
        su = tl.load(s + ((t * BLOCK_N + N) // 128) * KB + rk // 128)
    return wt, ut, xt, sv, su


@triton.jit
def _gemv_phase(pid, P, x, w, s, y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                AHEAD: tl.constexpr, GATE_UP: tl.constexpr):
    """y[N] = W x for an FP8 [N (x2 for gate/up), K] weight with [N/128, K/128] scales; gate/up:
    silu(W_g x) * (W_u x), the up rows N below the gate rows. The program's (row tile, K step)
    pairs run as one loop; AHEAD=1 loads the next step before this step's math (a persistent
    program has no sibling programs to hide load latency behind), AHEAD=0 leaves it to
    Triton's software pipeliner (num_stages)."""
    KSTEPS: tl.constexpr = K // BLOCK_K
    rb = tl.arange(0, BLOCK_N)
    steps = (N // BLOCK_N - pid + P - 1) // P * KSTEPS
    w0, u0, x0, s0, su0 = _step_loads(w, s, x, pid, P, N, 0, steps, K, BLOCK_N, BLOCK_K, GATE_UP)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for i in range(steps):
        if AHEAD:
            w1, u1, x1, s1, su1 = _step_loads(w, s, x, pid, P, N, i + 1, steps, K, BLOCK_N, BLOCK_K, GATE_UP)
        else:
            w0, u0, x0, s0, su0 = _step_loads(w, s, x, pid, P, N, i, steps, K, BLOCK_N, BLOCK_K, GATE_UP)
        xf = x0.to(tl.float32)
        acc += tl.sum(w0.to(tl.float32) * (xf * s0)[None, :], axis=1)
        if GATE_UP:
            acc_u += tl.sum(u0.to(tl.float32) * (xf * su0)[None, :], axis=1)
        if i % KSTEPS == KSTEPS - 1:
            out = acc
            if GATE_UP:
                out = acc / (1.0 + tl.exp(-acc)) * acc_u
            t = pid + (i // KSTEPS) * P
            tl.store(y + t * BLOCK_N + rb, out.to(y.dtype.element_ty))
            acc = tl.zeros([BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_N], tl.float32)
        if AHEAD:
            w0, u0, x0, s0, su0 = w1, u1, x1, s1, su1


@triton.jit
def _chain_kernel(x, wqkv, sqkv, yqkv, wo, so, yo, wgu, sgu, ygu, wd, sd, yd, bar, P,
                  HIDDEN: tl.constexpr, INTER: tl.constexpr, QKV: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, DEPTH: tl.constexpr):
    pid = tl.program_id(0)
    _gemv_phase(pid, P, x, wqkv, sqkv, yqkv, QKV, HIDDEN, BLOCK_N, BLOCK_K, AHEAD, False)
    _prefetch_phase(pid, P, wo, HIDDEN, HIDDEN, DEPTH, BLOCK_N, BLOCK_K, False)
    _grid_sync(bar, P)
    _gemv_phase(pid, P, yqkv, wo, so, yo, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K, AHEAD, False)
    _prefetch_phase(pid, P, wgu, INTER, HIDDEN, DEPTH, BLOCK_N, BLOCK_K, True)
    _grid_sync(bar, P)
    _gemv_phase(pid, P, yo, wgu, sgu, ygu, INTER, HIDDEN, BLOCK_N, BLOCK_K, AHEAD, True)
    _prefetch_phase(pid, P, wd, HIDDEN, INTER, DEPTH, BLOCK_N, BLOCK_K, False)
    _grid_sync(bar, P)
    _gemv_phase(pid, P, ygu, wd, sd, yd, HIDDEN, INTER, BLOCK_N, BLOCK_K, AHEAD, False)


@triton.jit
def _gemv_phase_tma(pid, P, x, wd, s, y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GATE_UP: tl.constexpr):
    """_gemv_phase with the weight tiles fetched by TMA (wd: a host tensor descriptor of the
    [rows, K] FP8 weight, [BLOCK_N, BLOCK_K] boxes), which the software pipeliner keeps
    num_stages deep in shared memory: bulk copies in flight without a register per byte."""
    KB: tl.constexpr = K // 128
    KSTEPS: tl.constexpr = K // BLOCK_K
    rb = tl.arange(0, BLOCK_N)
    steps = (N // BLOCK_N - pid + P - 1) // P * KSTEPS
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for i in range(steps):
        t = pid + (i // KSTEPS) * P
        k0 = (i % KSTEPS) * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        wt = wd.load([t * BLOCK_N, k0])
        xf = tl.load(x + rk, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(wt.to(tl.float32) * (xf * tl.load(s + (t * BLOCK_N // 128) * KB + rk // 128))[None, :], axis=1)
        if GATE_UP:
            ut = wd.load([t * BLOCK_N + N, k0])
            su = tl.load(s + ((t * BLOCK_N + N) // 128) * KB + rk // 128)
            acc_u += tl.sum(ut.to(tl.float32) * (xf * su)[None, :], axis=1)
        if i % KSTEPS == KSTEPS - 1:
            out = acc
            if GATE_UP:
                out = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(y + t * BLOCK_N + rb, out.to(y.dtype.element_ty))
            acc = tl.zeros([BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_N], tl.float32)


@triton.jit
def _chain_kernel_tma(x, wqkv, sqkv, yqkv, wo, so, yo, wgu, sgu, ygu, wd, sd, yd, bar, P,
                      HIDDEN: tl.constexpr, INTER: tl.constexpr, QKV: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    _gemv_phase_tma(pid, P, x, wqkv, sqkv, yqkv, QKV, HIDDEN, BLOCK_N, BLOCK_K, False)
    _grid_sync(bar, P)
    _gemv_phase_tma(pid, P, yqkv, wo, so, yo, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K, False)
    _grid_sync(bar, P)
    _gemv_phase_tma(pid, P, yo, wgu, sgu, ygu, INTER, HIDDEN, BLOCK_N, BLOCK_K, True)
    _grid_sync(bar, P)
    _gemv_phase_tma(pid, P, ygu, wd, sd, yd, HIDDEN, INTER, BLOCK_N, BLOCK_K, False)


def _fp8_weight(n, k, gen, device):
    """A random [n, k] weight, block-FP8 as the benches and the engine's loader make it."""
    from .small_batch_linear import _fp8_weight as block_fp8
    return block_fp8(torch.randn(n, k, device=device, generator=gen) * k ** -0.5)


def random_layers(count, device, qkv=QKV, hidden=HIDDEN, inter=INTER):
    """count layers of random block-FP8 weights (qkv, o, stacked gate/up, down)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [{"qkv": _fp8_weight(qkv, hidden, gen, device), "o": _fp8_weight(hidden, hidden, gen, device),
             "gu": _fp8_weight(2 * inter, hidden, gen, device), "d": _fp8_weight(hidden, inter, gen, device)}
            for _ in range(count)]


def separate_chain(layers, x0, pdl, workspace):
    from kernels.fp8_linear import fp8_gate_up_silu, fp8_linear

    def run():
        x = x0
        for lw in layers:
            qkv = fp8_linear(x, lw["qkv"], workspace=workspace, pdl=pdl)
            o = fp8_linear(qkv[:, :HIDDEN], lw["o"], workspace=workspace, pdl=pdl)
            g = fp8_gate_up_silu(o, lw["gu"], workspace=workspace, pdl=pdl)
            x = fp8_linear(g, lw["d"], workspace=workspace, pdl=pdl)
        return x
    return run


def separate_layer(lw, x0, pdl, workspace) -> dict:
    """One layer's four outputs (flat) by the engine's kernels, as separate_chain runs them."""
    from kernels.fp8_linear import fp8_gate_up_silu, fp8_linear

    out = {"qkv": fp8_linear(x0, lw["qkv"], workspace=workspace, pdl=pdl).view(-1)}
    out["o"] = fp8_linear(out["qkv"][:HIDDEN].view(1, -1), lw["o"], workspace=workspace, pdl=pdl).view(-1)
    out["gu"] = fp8_gate_up_silu(out["o"].view(1, -1), lw["gu"], workspace=workspace, pdl=pdl).view(-1)
    out["d"] = fp8_linear(out["gu"].view(1, -1), lw["d"], workspace=workspace, pdl=pdl).view(-1)
    return out


def persistent_chain(layers, x0, programs, depth, block_n=16, block_k=512, ahead=1, warps=4, coop=True,
                     stages=1):
    """The chain as one persistent kernel a layer; returns (run, the layers' output buffers).
    coop: a cooperative launch, which fails rather than hangs if the grid cannot be resident."""
    dev = x0.device
    qkv, hidden, inter = _dims(layers[0])
    nan = float("nan")  # poisoned: a phase that reads before the barrier shows
    bufs = [{"qkv": torch.full((qkv,), nan, dtype=torch.bfloat16, device=dev),
             "o": torch.full((hidden,), nan, dtype=torch.bfloat16, device=dev),
             "gu": torch.full((inter,), nan, dtype=torch.bfloat16, device=dev),
             "d": torch.full((hidden,), nan, dtype=torch.bfloat16, device=dev)} for _ in layers]
    bar = torch.zeros(1, dtype=torch.int64, device=dev)

    if ahead < 0:  # TMA
        from triton.tools.tensor_descriptor import TensorDescriptor
        descs = [{k: TensorDescriptor.from_tensor(lw[k].q, [block_n, block_k]) for k in ("qkv", "o", "gu", "d")}
                 for lw in layers]

    def run():
        x = x0.view(-1)
        for li, (lw, b) in enumerate(zip(layers, bufs)):
            if ahead < 0:
                d = descs[li]
                _chain_kernel_tma[(programs,)](
                    x, d["qkv"], lw["qkv"].scale, b["qkv"], d["o"], lw["o"].scale, b["o"],
                    d["gu"], lw["gu"].scale, b["gu"], d["d"], lw["d"].scale, b["d"], bar, programs,
                    HIDDEN=hidden, INTER=inter, QKV=qkv, BLOCK_N=block_n, BLOCK_K=block_k,
                    num_warps=warps, num_stages=stages, launch_cooperative_grid=coop)
                x = b["d"]
                continue
            _chain_kernel[(programs,)](
                x, lw["qkv"].q, lw["qkv"].scale, b["qkv"], lw["o"].q, lw["o"].scale, b["o"],
                lw["gu"].q, lw["gu"].scale, b["gu"], lw["d"].q, lw["d"].scale, b["d"], bar, programs,
                HIDDEN=hidden, INTER=inter, QKV=qkv, BLOCK_N=block_n, BLOCK_K=block_k, AHEAD=ahead,
                DEPTH=depth, num_warps=warps, num_stages=stages, launch_cooperative_grid=coop)
            x = b["d"]
        return x.view(1, -1)
    run.barrier = bar
    return run, bufs


def _dims(lw) -> tuple[int, int, int]:
    """(qkv rows, hidden, intermediate) of one layer's weights."""
    return lw["qkv"].q.shape[0], lw["o"].q.shape[0], lw["d"].q.shape[1]


def one_program_chain(layer, x, ahead: int, block_n: int, block_k: int) -> tuple[dict, int]:
    """One layer's chain by the persistent kernel as a single program (where every grid barrier
    is passed at once; the CPU interpreter runs programs one after another, so a grid of more
    would spin forever there): (the four outputs, the barrier's arrival count)."""
    run, bufs = persistent_chain([layer], x, 1, 0, block_n, block_k, ahead, 4, False, 1)
    run()
    return bufs[0], int(run.barrier.item())


def reference_layer(x, lw) -> dict:
    """One layer's chain in fp32 from the dequantized weights, each output rounded to bf16."""
    _, hidden, inter = _dims(lw)

    def lin(v, w):
        return v.float() @ w.dequantize().T
    qkv = lin(x, lw["qkv"]).to(torch.bfloat16)
    o = lin(qkv[:hidden], lw["o"]).to(torch.bfloat16)
    gu = lin(o, lw["gu"])
    g = (torch.nn.functional.silu(gu[:inter]) * gu[inter:]).to(torch.bfloat16)
    return {"qkv": qkv, "o": o, "gu": g, "d": lin(g, lw["d"]).to(torch.bfloat16)}


def phase_errors(bufs, ref) -> dict:
    """Each output's largest difference against the fp32 chain, over its largest value (NaN
    where an output was read before it was written: the buffers start poisoned)."""
    return {k: ((bufs[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max()).item()
            for k in ("qkv", "o", "gu", "d")}


@dataclass
class ChainSetup:
    """What both chain probes start from: distinct random layers on the GPU, a bf16 row, and
    the layer's floor at the benches' copy speed (loadtest/bench/shapes.py copy_gb_s: eager,
    read + write)."""
    dev: torch.device
    layers: list
    x0: torch.Tensor
    layer_bytes: int
    floor_us: float

    @classmethod
    def create(cls, count: int, say) -> ChainSetup:
        from .shapes import copy_gb_s

        dev = torch.device("cuda")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        say(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs, {count} layers")
        layers = random_layers(count, dev)
        layer_bytes = QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER
        x0 = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
        copy = copy_gb_s(dev) * 1e9
        floor_us = layer_bytes / copy * 1e6
        say(f"copy {copy / 1e9:.0f} GB/s; a layer's FP8 weights {layer_bytes / 1e6:.1f} MB -> floor {floor_us:.1f} us")
        return cls(dev, layers, x0, layer_bytes, floor_us)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="distinct layers' weights in a replay (past L2)")
    p.add_argument("--prefetch", default="0,2", help="L2 prefetch depths to try for the persistent chain")
    p.add_argument("--tilings", default="16x512x4x1x1,16x512x8x1x1,16x512x4x0x1,16x512x4x0x4,32x256x4x-1x4",
                   help="BLOCK_N x BLOCK_K x warps x ahead (1: a step ahead by hand, 0: the pipeliner, -1: TMA "
                        "tiles through the pipeliner) x stages")
    p.add_argument("--programs-per-sm", default="1,2")
    p.add_argument("--no-coop", action="store_true", help="plain launches (if cooperative ones fail in graphs)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from kernels.pdl import Pdl, pdl_supported
    from kernels.small_batch_linear import SmallBatchWorkspace
    from loadtest.bench.small_batch_linear import graph_replay_ms

    say = lambda s: print(s, flush=True)
    setup = ChainSetup.create(args.layers, say)
    dev, layers, x0, floor_us = setup.dev, setup.layers, setup.x0, setup.floor_us
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    rows = []
    pdl = Pdl() if pdl_supported(dev) else None
    ws = SmallBatchWorkspace.create(dev)
    ref0 = reference_layer(x0.view(-1), layers[0])
    err = max(phase_errors(separate_layer(layers[0], x0, pdl, ws), ref0).values())
    us = graph_replay_ms([separate_chain(layers, x0, pdl, ws)], 10) * 1e3 / args.layers
    rows.append(("separate (engine kernels, PDL)", us, err))
    say(f"separate: {us:.1f} us a layer, layer 0 max rel err {err:.1e}")
    for tiling in args.tilings.split(","):
        bn, bk, warps, ahead, stages = (int(v) for v in tiling.split("x"))
        for per_sm in (int(v) for v in args.programs_per_sm.split(",")):
            for depth in (int(v) for v in args.prefetch.split(",")):
                if ahead < 0 and depth:
                    continue  # the TMA kernel has no L2 prefetch
                kind = {1: "a step ahead", 0: "pipeliner", -1: "TMA"}[ahead]
                label = f"persistent bn{bn} bk{bk} w{warps} {kind} stages{stages} {per_sm}/SM prefetch {depth}"
                try:
                    run, bufs = persistent_chain(layers, x0, sms * per_sm, depth, bn, bk, ahead, warps,
                                                 not args.no_coop, stages)
                    run()
                    torch.cuda.synchronize()
                    err = max(phase_errors(bufs[0], ref0).values())
                    us = graph_replay_ms([run], 10) * 1e3 / args.layers
                except Exception as e:  # noqa: BLE001 - a tiling that fails is reported, the rest run
                    say(f"{label}: failed {type(e).__name__}: {str(e)[:160]}")
                    continue
                rows.append((label, us, err))
                say(f"{label}: {us:.1f} us a layer, layer 0 max rel err {err:.1e}")
    say("")
    say(f"| chain of qkv, o, gate/up+SwiGLU, down (one row, FP8) | us a layer | x floor ({floor_us:.1f}) "
        f"| layer 0 vs fp32, max rel err |")
    say("|---|---|---|---|")
    for label, us, err in rows:
        say(f"| {label} | {us:.1f} | {us / floor_us:.2f} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
