"""Where a one-row FP8 GEMV's time goes (needs CUDA): the small-batch kernel's CUDA-core tiles
reach 2.1-2.9 TB/s on FP8 weights against ~3.9 TB/s for 16-bit ones (kernels/NOTES.md).

One probe kernel (split-K, fp32 atomics into a zeroed output: a probe, not the engine's
deterministic kernel) over the same tilings, changing only what happens to each weight:
  bytes        integer sum of the raw bytes (no float work): the load structure's ceiling
  cvt          widen to fp32 (Triton's e4m3 conversion), times x: no scale
  cvt+scale    cvt, times the row's block scale: the engine kernel's arithmetic
  bits+scale   e4m3 -> fp32 by integer shifts (sign, exponent and mantissa moved into place, the
               2^120 exponent-bias gap folded into the block scale): no conversion instruction
  f16 dot      weights widened to fp16 (one conversion per two), x given in fp16 (scaled
               beforehand): the tensor-core path without its per-step x scaling
beside the engine's kernel with its tuned tiling. Weights past L2 (CUDA graphs over copies),
as a decode step reads them. Prints us and GB/s per (shape, variant), best tiling each.

    python3 -m loadtest.bench.fp8_gemv_probe [--shapes gate_up,down,qkv,o]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.language as tl

SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096), "o": (4096, 4096)}
VARIANTS = ("bytes", "cvt", "cvt+scale", "bits+scale", "f16 dot")
TILINGS = ((16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 256, 8), (32, 512, 8), (64, 128, 4))


@triton.jit
def _probe_kernel(x_ptr, x16_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, N, K, k_per_split, stride_s,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VARIANT: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    k_start = tl.program_id(1) * k_per_split
    rk = tl.arange(0, 128)
    s_rows = s_ptr + (rows // 128) * stride_s
    if VARIANT == 4:
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
    elif VARIANT == 0:
        acci = tl.zeros([BLOCK_N, 128], tl.int32)
    else:
        acc = tl.zeros([BLOCK_N, 128], tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // 128):
            ks = k0 + sub * 128
            wt = tl.load(w_ptr + rows[:, None] * K + (ks + rk)[None, :])
            sc = tl.load(s_rows + ks // 128)
            if VARIANT == 0:
                acci += wt.to(tl.uint8, bitcast=True).to(tl.int32)
            elif VARIANT == 1:
                acc += wt.to(tl.float32) * tl.load(x_ptr + ks + rk).to(tl.float32)[None, :]
            elif VARIANT == 2:
                acc += wt.to(tl.float32) * sc[:, None] * tl.load(x_ptr + ks + rk).to(tl.float32)[None, :]
            elif VARIANT == 3:
                u = wt.to(tl.uint8, bitcast=True).to(tl.uint32)
                f = (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True)
                acc += f * (sc * 1.329228e36)[:, None] * tl.load(x_ptr + ks + rk).to(tl.float32)[None, :]  # 2^120
            else:
                xt = tl.load(x16_ptr + tl.arange(0, 16)[:, None] * K + (ks + rk)[None, :])  # rows 1..15: zeros
                acc += tl.dot(wt.to(tl.float16), tl.trans(xt)) * sc[:, None]
    if VARIANT == 0:
        total = tl.sum(acci, axis=1).to(tl.float32)
    elif VARIANT == 4:
        total = tl.sum(acc, axis=1) * tl.load(xs_ptr)  # column 0 is the real row
    else:
        total = tl.sum(acc, axis=1)
    tl.atomic_add(out_ptr + rn, total, mask=rn < N)


def run_probe(variant: int, x, x16, xs, w, out, tiling, split):
    n, k = w.q.shape
    bn, bk, warps = tiling
    per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    _probe_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per_split))](
        x, x16, xs, w.q, w.scale, out, n, k, per_split, w.scale.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, VARIANT=variant, num_warps=warps, num_stages=1)


def main(argv=None) -> int:
    from kernels.fp8_linear import small_batch_fp8_linear, small_batch_fp8_reference
    from kernels.small_batch_linear import SmallBatchWorkspace
    from .small_batch_linear import FP8_BLOCK, Setup, WeightCopies, graph_replay_ms

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.fp8_gemv_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gate_up,down,qkv,o")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    setup = Setup.for_device()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name(0)}, triton {triton.__version__}, block {FP8_BLOCK}", flush=True)
    table = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = WeightCopies(setup, n, k, gen, fp8=True)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        amax = x.float().abs().max()
        xs = (amax / 8192).reshape(1)  # x16 = x / xs: largest |x| 8192, exact in fp16
        x16 = torch.zeros(16, k, device="cuda", dtype=torch.float16)
        x16[0] = (x.float() / xs).half()
        out = torch.zeros(n, device="cuda", dtype=torch.float32)
        ws = SmallBatchWorkspace.create("cuda")
        ref = small_batch_fp8_reference(x, copies.weights[0]).float()[0]
        engine_us = graph_replay_ms([lambda w=w: small_batch_fp8_linear(x, w, workspace=ws) for w in copies.weights],
                                    10) * 1e3 / copies.count
        table.append((name, "engine kernel (tuned)", engine_us, copies.nbytes / engine_us / 1e3, "", float("nan")))
        for v, label in enumerate(VARIANTS):
            best = None
            for tiling in TILINGS:
                tiles = triton.cdiv(n, tiling[0])
                split = max(1, min(-(-2 * sms // tiles), k // tiling[1]))
                try:
                    us = graph_replay_ms([lambda w=w: run_probe(v, x, x16, xs, w, out, tiling, split)
                                          for w in copies.weights], 10) * 1e3 / copies.count
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is skipped
                    print(f"  {name} {label} {tiling} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, tiling, split)
            if best is None:
                continue
            out.zero_()
            run_probe(v, x, x16, xs, copies.weights[0], out, best[1], best[2])
            err = ((out - ref).norm() / ref.norm()).item() if v else float("nan")
            table.append((name, label, best[0], copies.nbytes / best[0] / 1e3, f"bn{best[1][0]} bk{best[1][1]} "
                          f"w{best[1][2]} split{best[2]}", err))
            print(f"  {name} {label}: {best[0]:.2f} us", flush=True)
        del copies
        torch.cuda.empty_cache()
    print(f"\n=== fp8_gemv_probe (M=1, FP8 weights past L2), {time.time() - t0:.0f} s ===")
    print(f"{'shape':<8}{'variant':<24}{'us':>8}{'GB/s':>7}  {'rel err':>8}  tiling")
    for name, label, us, gbs, tiling, err in table:
        print(f"{name:<8}{label:<24}{us:8.2f}{gbs:7.0f}  {err:8.1e}  {tiling}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
