"""Two ways around the FP8 GEMV's widening cost at decode sizes (needs CUDA), probed beside the
engine's small-batch kernel and the load structure's own ceiling (fp8_gemv_probe's "bytes").

fp8_gemv_probe put the engine's one-row FP8 GEMV at 75 us a Qwen3-8B layer against 62 for a
kernel that only sums the raw bytes: the widening (e4m3 -> fp16 -> fp32, then an FMA a
weight) is the difference. The candidates:
  f16 chunks   (one row) each thread's 16 contiguous weights of a row times x's matching 16
               values in fp16 (x scaled per 16-column chunk by a power of two that keeps 16
               products inside fp16), summed in fp16, then one widening and one FMA per 16
               weights instead of per weight.
  w8a8 swap    (1..64 rows) no widening at all: x's K step quantized to FP8 in the kernel (per
               row, per 128-column group: the prefill recipe), an FP8 tensor-core dot with the
               weight tile as the MMA's M side (128 or 64 weight rows, x's rows padded to 16:
               the "swap AB" of small-M FP8 GEMMs), promoted per step with both scales.
Split-K with fp32 atomics into a zeroed output (a probe: the engine's kernel is deterministic).
Weights past L2 (CUDA graphs over copies), as a decode step reads them. Prints us, GB/s of
weight bytes and the error against the W8A16 reference, best tiling each.

    python3 -m loadtest.bench.fp8_decode_linear_probe [--shapes gate_up,down,qkv,o] [--m 1,32]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.language as tl

from kernels.triton_fp8 import fp8_grid

SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096), "o": (4096, 4096)}
GROUP = 128  # weight block and activation group
CHUNK_TILINGS = ((16, 4), (32, 4), (32, 8), (64, 8))  # (rows a program, warps); K step = one group
SWAP_TILINGS = ((64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 4, 4), (128, 8, 4))  # (weight rows, warps, stages)


@triton.jit
def _f16_chunk_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, k_per_split, stride_s,
                      BLOCK_N: tl.constexpr, CH: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    k_start = tl.program_id(1) * k_per_split
    G2: tl.constexpr = 128 // CH
    g2 = tl.arange(0, G2)
    ch = tl.arange(0, CH)
    cols = g2[:, None] * CH + ch[None, :]  # [G2, CH]: one group
    s_rows = s_ptr + (rows // 128) * stride_s
    acc = tl.zeros([BLOCK_N, G2], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), 128):
        wt = tl.load(w_ptr + rows[:, None, None] * K + (k0 + cols)[None, :, :])
        xf = tl.load(x_ptr + k0 + cols).to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129  # largest |x| of a chunk in [4, 8)
        e = tl.minimum(tl.maximum(e, -126), 126)
        up = ((127 - e) << 23).to(tl.float32, bitcast=True)
        down = ((127 + e) << 23).to(tl.float32, bitcast=True)
        x16 = (xf * up[:, None]).to(tl.float16)
        part = tl.sum(wt.to(tl.float16) * x16[None, :, :], axis=2)  # fp16: 16 products, |sum| < 57344
        acc += part.to(tl.float32) * (tl.load(s_rows + k0 // 128)[:, None] * down[None, :])
    tl.atomic_add(out_ptr + rn, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _w8a8_swap_kernel(x_ptr, w_desc, s_ptr, out_ptr, M, N, K, k_per_split, stride_x, stride_s, stride_o,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    off_n = tl.program_id(0) * BLOCK_N
    rn = off_n + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, 128)
    k_start = tl.program_id(1) * k_per_split
    s_rows = s_ptr + (rows // 128) * stride_s
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), 128):
        wt = w_desc.load([off_n, k0])  # TMA: rows past N read as zeros
        xf = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        sx = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-10) / 448.0
        xq = fp8_grid(xf / sx[:, None]).to(tl.float8e4nv)
        d = tl.dot(wt, tl.trans(xq))
        acc += d * (tl.load(s_rows + k0 // 128)[:, None] * sx[None, :])
    tl.atomic_add(out_ptr + rm[None, :] * stride_o + rn[:, None], acc, mask=(rn < N)[:, None] & m_ok[None, :])


def _split(n_tiles: int, k: int, sms: int, step: int = GROUP) -> int:
    """K splits that give ~2 programs an SM, each a whole number of steps (fp8_gemv_probe's
    kernel has no K mask: its splits must divide K)."""
    want = max(1, min(-(-2 * sms // n_tiles), k // step))
    while (k // step) % want:
        want -= 1
    return want


def run_chunks(x, w, out, tiling, sms):
    n, k = w.q.shape
    bn, warps = tiling
    split = _split(triton.cdiv(n, bn), k, sms)
    per = triton.cdiv(triton.cdiv(k, split), GROUP) * GROUP
    _f16_chunk_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        x, w.q, w.scale, out, n, k, per, w.scale.stride(0), BLOCK_N=bn, CH=16, num_warps=warps, num_stages=2)


def _desc(q, block_n):
    """A TMA descriptor of the weight in [block_n, 128] tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(q, [block_n, GROUP])


def run_swap(x, w, out, tiling, sms):
    n, k = w.q.shape
    m = x.shape[0]
    bn, warps, stages = tiling
    split = _split(triton.cdiv(n, bn), k, sms)
    per = triton.cdiv(triton.cdiv(k, split), GROUP) * GROUP
    _w8a8_swap_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        x, _desc(w.q, bn), w.scale, out, m, n, k, per, x.stride(0), w.scale.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    from kernels.fp8_decode_gemm import fp8_decode_linear
    from kernels.fp8_linear import small_batch_fp8_linear, small_batch_fp8_reference
    from loadtest.bench.accuracy import relative_error
    from kernels.small_batch_linear import SmallBatchWorkspace
    from .fp8_gemv_probe import TILINGS as BYTE_TILINGS
    from .fp8_gemv_probe import run_probe
    from .small_batch_linear import Setup, WeightCopies, graph_replay_ms

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.fp8_decode_linear_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gate_up,down,qkv,o")
    p.add_argument("--m", default="1,32")
    p.add_argument("--engine", action="store_true",
                   help="instead: the engine's two decode kernels as a step calls them (gate/up fused with SwiGLU, "
                        "PDL at one row) and the decode GEMM's tilings")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    setup = Setup.for_device()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name(0)}, triton {triton.__version__}", flush=True)
    table = []

    def time_fn(copies, make):
        return graph_replay_ms([make(w) for w in copies.weights], 10) * 1e3 / copies.count

    if args.engine:
        return engine_sweep(args, setup, gen, sms, time_fn, t0)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = WeightCopies(setup, n, k, gen, fp8=True)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = small_batch_fp8_reference(x, copies.weights[0]).float()
            out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
            ws = SmallBatchWorkspace.create("cuda")
            if m <= 32:
                us = time_fn(copies, lambda w: (lambda: small_batch_fp8_linear(x, w, workspace=ws)))
                table.append((name, m, "engine (tuned)", us, copies.nbytes / us / 1e3, 0.0, ""))
                print(f"  {name} m{m} engine: {us:.2f} us", flush=True)
            us = time_fn(copies, lambda w: (lambda: fp8_decode_linear(x, w, workspace=ws)))
            err = relative_error(fp8_decode_linear(x, copies.weights[0], workspace=ws), ref)
            table.append((name, m, "decode GEMM", us, copies.nbytes / us / 1e3, err, "engine's"))
            print(f"  {name} m{m} decode GEMM: {us:.2f} us", flush=True)
            candidates = [("w8a8 swap", SWAP_TILINGS, run_swap)]
            if m == 1:
                candidates = [("bytes", BYTE_TILINGS, None), ("f16 chunks", CHUNK_TILINGS, run_chunks)] + candidates
            for label, tilings, runner in candidates:
                best = None
                for tiling in tilings:
                    if runner is None:  # the byte-sum ceiling of fp8_gemv_probe
                        split = _split(triton.cdiv(n, tiling[0]), k, sms, tiling[1])
                        fn = (lambda t, s: lambda w: (lambda: run_probe(0, x, x, x, w, out[0], t, s)))(tiling, split)
                    else:
                        fn = (lambda t, r: lambda w: (lambda: r(x, w, out, t, sms)))(tiling, runner)
                    try:
                        us = time_fn(copies, fn)
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile is skipped
                        print(f"  {name} m{m} {label} {tiling} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, tiling)
                if best is None:
                    continue
                err = float("nan")
                if runner is not None:
                    out.zero_()
                    runner(x, copies.weights[0], out, best[1], sms)
                    err = ((out - ref).norm() / ref.norm()).item()
                table.append((name, m, label, best[0], copies.nbytes / best[0] / 1e3, err, str(best[1])))
                print(f"  {name} m{m} {label}: {best[0]:.2f} us {best[1]}", flush=True)
        del copies
        torch.cuda.empty_cache()
    print(f"\n=== fp8_decode_linear_probe (FP8 weights past L2), {time.time() - t0:.0f} s ===")
    print(f"{'shape':<8}{'M':>3}  {'variant':<16}{'us':>8}{'GB/s':>7}  {'rel err':>8}  tiling")
    for name, m, label, us, gbs, err, tiling in table:
        print(f"{name:<8}{m:>3}  {label:<16}{us:8.2f}{gbs:7.0f}  {err:8.1e}  {tiling}")
    return 0


DECODE_SWEEP = [(bn, w, st, sm) for bn, w in ((64, 4), (128, 4), (128, 8)) for st in (3, 4) for sm in (1, 2, 4)]


def engine_sweep(args, setup, gen, sms, time_fn, t0) -> int:
    """The small-batch kernel and the decode GEMM through their wrappers, as a decode step calls
    them: gate/up fused with SwiGLU, the deterministic split-K, PDL at one row (kernels/pdl.py);
    the decode GEMM's default tiling and the best of DECODE_SWEEP ((block_n, warps, stages,
    programs an SM))."""
    from dataclasses import replace

    from kernels.fp8_decode_gemm import Fp8DecodeConfig, decode_config, fp8_decode_linear
    from kernels.fp8_linear import small_batch_fp8_linear
    from kernels.pdl import Pdl
    from kernels.small_batch_linear import SmallBatchWorkspace
    from .small_batch_linear import WeightCopies

    table = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        gate_up = name == "gate_up"
        copies = WeightCopies(setup, n, k, gen, fp8=True)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ws = SmallBatchWorkspace.create("cuda")
            for pdl in ((None, Pdl()) if m == 1 else (None,)):
                tag = " pdl" if pdl else ""
                us = time_fn(copies, lambda w: (lambda: small_batch_fp8_linear(x, w, workspace=ws, pdl=pdl, gate_up=gate_up)))
                table.append((name, m, f"small-batch{tag}", us, ""))
                sms_dev = torch.cuda.get_device_properties(0).multi_processor_count
                default = decode_config(m, n, k, sms_dev, gate_up, 128, x.device)
                # prequant: x quantized once by its own kernel before the GEMM (Fp8DecodeConfig.prequant)
                for pre in (False, True):
                    label = "decode" + (" prequant" if pre else "")
                    cfg0 = replace(default, prequant=pre)
                    us = time_fn(copies, lambda w: (lambda: fp8_decode_linear(x, w, workspace=ws, pdl=pdl, config=cfg0,
                                                                              gate_up=gate_up)))
                    table.append((name, m, f"{label} default{tag}", us, ""))
                    best = None
                    tiles_rows = n // 2 if gate_up else n
                    for bn, warps, stages, per_sm in DECODE_SWEEP:
                        split = max(1, min(k // 128, -(-per_sm * sms // -(-tiles_rows // bn))))
                        cfg = Fp8DecodeConfig(bn, warps, stages, split, prequant=pre)
                        try:
                            us = time_fn(copies, lambda w: (lambda: fp8_decode_linear(
                                x, w, workspace=ws, pdl=pdl, config=cfg, gate_up=gate_up)))
                        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is skipped
                            print(f"  {name} m{m} {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                            continue
                        if best is None or us < best[0]:
                            best = (us, cfg)
                    table.append((name, m, f"{label} best{tag}", best[0], f"bn{best[1].block_n} w{best[1].num_warps} "
                                  f"st{best[1].num_stages} split{best[1].split_k}"))
                print("  " + " | ".join(f"{r[2]} {r[3]:.2f}" for r in table[-5:]), flush=True)
        del copies
        torch.cuda.empty_cache()
    print(f"\n=== fp8_decode_linear_probe --engine (FP8 weights past L2; gate_up fused), {time.time() - t0:.0f} s ===")
    print(f"{'shape':<8}{'M':>3}  {'variant':<27}{'us':>8}  tiling")
    for name, m, label, us, tiling in table:
        print(f"{name:<8}{m:>3}  {label:<27}{us:8.2f}  {tiling}")
    sums: dict = {}
    for name, m, label, us, _ in table:
        sums[(m, label)] = sums.get((m, label), 0.0) + us
    for (m, label), us in sums.items():
        print(f"a layer's linears, M={m}, {label}: {us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
