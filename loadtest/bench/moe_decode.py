"""A decode batch's MoE block on the device: the launch sequences the model can run, timed.

    python3 -m loadtest.bench.moe_decode [--m 1,2,4,8,16] [--tiles] [--fp8]
    TRITON_INTERPRET=1 python -m loadtest.bench.moe_decode --smoke   # CPU: checks the script

Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, expert intermediate 768, bf16),
random weights and activations. Per token count M, each variant's whole block (router
included) as one CUDA-graph replay with L2 flushed before it:
- gemm+grouped: router GEMM (cuBLAS), top-k kernel, expert sort, two grouped GEMMs, top-k
  sum (seven launches: the path before kernels/moe_decode.py);
- route+grouped: router and top-k in one kernel, then the grouped experts;
- route+pairs: router and top-k, then one experts kernel (per-pair gate/up, per-pair down
  with the top-k sum fused): two launches, at each DecodeTile of --tiles.
--fp8: the experts block-FP8 (128 x 128, kernels/fp8_moe.py experts_fp8; the router stays 16-bit),
route+pairs only, each tile against the W8A16 reference.
Floor: bytes the block must read (router weight, the experts the batch's routing touches,
activations) over the device-copy bandwidth measured in the same run. Short table last."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

SHAPE = (128, 2048, 768, 8)  # experts, hidden, intermediate, top_k
SMOKE_SHAPE = (8, 64, 32, 2)


@dataclass
class Row:
    m: int
    variant: str
    ms: float
    floor_ms: float
    relerr: float


def tile_grid(smoke: bool):
    from kernels.moe_decode import DecodeTile
    if smoke:
        return [DecodeTile(4, 32, 4, 8, 32, 16, 16, 4)]
    grid = [DecodeTile(), DecodeTile(warps=4)]
    for gn, gk in ((16, 256), (16, 1024), (8, 1024), (64, 256), (32, 128), (32, 512), (64, 128)):
        grid.append(DecodeTile(gate_up_block_n=gn, gate_up_block_k=gk))
    # whole-row down tiles (1024 >= the 768-wide intermediate): every down weight loaded before the wait
    for dn, dk, w in ((8, 256, 4), (32, 256, 4), (16, 512, 4), (16, 256, 2), (16, 256, 8), (32, 256, 8),
                      (8, 1024, 4), (16, 1024, 4), (16, 1024, 8), (32, 1024, 8), (32, 512, 4)):
        grid.append(DecodeTile(down_block_n=dn, down_block_k=dk, warps=w))
    for be, bk, w in ((1, 2048, 1), (4, 2048, 4), (8, 512, 4), (2, 1024, 1)):
        grid.append(DecodeTile(router_block_e=be, router_block_k=bk, router_warps=w))
    return grid


def main(argv=None) -> int:
    from kernels import moe_decode
    from loadtest.bench.accuracy import relative_error
    from kernels.fused_moe import fused_moe, select_experts

    from .kernels import BenchConfig, bench_replay, copy_bandwidth

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.moe_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,2,4,8,16")
    p.add_argument("--tiles", action="store_true", help="sweep DecodeTile variants for route+pairs")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--fp8", action="store_true", help="block-FP8 experts (route+pairs only)")
    a = p.parse_args(argv)
    cfg = BenchConfig.smoke() if a.smoke else BenchConfig()
    if cfg.device != "cuda" and not a.smoke:
        print("moe_decode needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dev, dtype = cfg.device, (torch.float32 if a.smoke else torch.bfloat16)
    e, h, i, k = SMOKE_SHAPE if a.smoke else SHAPE
    copy = copy_bandwidth(cfg)
    print(f"copy {copy / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    router = (torch.randn(e, h, generator=gen) * 2 / h ** 0.5).to(dev, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dev, dtype)
    fp8 = _fp8_experts(w13, w2, 16 if a.smoke else 128) if a.fp8 else None
    ms_list = [1, 3] if a.smoke else [int(v) for v in a.m.split(",")]
    tiles = tile_grid(a.smoke) if a.tiles or a.smoke else [moe_decode.DecodeTile()]
    counters = moe_decode.DecodeCounters.create(max(ms_list), e, k, h, i, moe_decode.DecodeTile(), dev)
    rows: list[Row] = []
    for m in ms_list:
        x = torch.randn(m, h, generator=gen).to(dev, dtype)
        want, _, ids = moe_decode.moe_decode_reference(x, router, w13, w2, k, True, dtype)
        touched = int(torch.unique(ids).numel())
        expert_bytes = touched * 3 * h * i * (1 if fp8 else x.element_size())
        nbytes = (router.numel() + 2 * x.numel()) * x.element_size() + expert_bytes
        floor = nbytes / copy * 1e3
        out = torch.empty_like(x)

        def gemm_grouped():
            logits = torch.nn.functional.linear(x, router)
            w, ids_ = select_experts(logits, k, True, round_weights_to=dtype)
            return fused_moe(x, w13, w2, w, ids_, out=out)

        def route_grouped():
            w, ids_ = moe_decode.route(x, router, k, True, dtype, counters=counters)
            return fused_moe(x, w13, w2, w, ids_, out=out)

        variants = [] if fp8 else [("gemm+grouped", gemm_grouped, None), ("route+grouped", route_grouped, None)]
        if fp8:
            from kernels.fp8_moe import experts_fp8, fused_moe_fp8, fused_moe_fp8_reference
            w_, ids_ = moe_decode.route(x, router, k, True, dtype, counters=counters)
            want = fused_moe_fp8_reference(x, fp8[0], fp8[1], w_, ids_, quantize_activations=False).to(dtype)

            def route_grouped_fp8():  # the W8A8 grouped GEMMs the engine runs past EXPERTS_DECODE_MAX_TOKENS
                w, ids_ = moe_decode.route(x, router, k, True, dtype, counters=counters)
                return fused_moe_fp8(x, fp8[0], fp8[1], w, ids_, out=out)
            variants.append(("route+grouped fp8 (W8A8)", route_grouped_fp8, None))
        for tile in tiles:
            c = moe_decode.DecodeCounters.create(max(ms_list), e, k, h, i, tile, dev)

            def pairs(tile=tile, c=c):
                w, ids_ = moe_decode.route(x, router, k, True, dtype, counters=c, tile=tile)
                if fp8:
                    return experts_fp8(x, fp8[0], fp8[1], w, ids_, counters=c, out=out, tile=tile)
                return moe_decode.experts(x, w13, w2, w, ids_, counters=c, out=out, tile=tile)
            variants.append((f"route+pairs{' fp8' if fp8 else ''} {_short(tile)}", pairs, tile))
        for name, fn, _ in variants:
            try:
                err = relative_error(fn().float(), want.float())
                ms = bench_replay(cfg, fn)
            except Exception as ex:  # noqa: BLE001 - a tile that does not compile
                print(f"  M={m} {name}: {type(ex).__name__} {ex}"[:200], flush=True)
                continue
            rows.append(Row(m, name, ms, floor, err))
            print(f"M={m} touched {touched} {name}: {ms * 1e3:.1f} us (floor {floor * 1e3:.1f}, "
                  f"x{ms / floor:.2f}) relerr {err:.1e}", flush=True)
    print("\n=== moe_decode (us per block; floor = router + touched experts' bytes / copy BW) ===")
    for m in ms_list:
        mine = [r for r in rows if r.m == m]
        if not mine:
            continue
        best = min(mine, key=lambda r: r.ms)
        base = next((r for r in mine if r.variant == "gemm+grouped"), best)
        for r in mine if a.tiles else mine:
            mark = " <- best" if r is best else ""
            print(f"M={m:<3} {r.variant:<44} {r.ms * 1e3:8.1f} us  x{r.ms / r.floor_ms:5.2f} floor  "
                  f"{base.ms / r.ms:5.2f}x vs gemm+grouped  relerr {r.relerr:.1e}{mark}")
    return 0


def _fp8_experts(w13, w2, block: int):
    """Block-FP8 copies of the stacked experts (kernels.fp8.Fp8Weight), each expert quantized on
    its own block x block grid (gate and up share one: I is a multiple of the block)."""
    from kernels.fp8 import Fp8Weight, quantize_block

    def stack(w):
        qs, ss = zip(*(quantize_block(w[j], (block, block)) for j in range(w.shape[0])))
        rows = (torch.arange(w.shape[1], device=w.device) // block).to(torch.int32)
        return Fp8Weight(torch.stack(qs), torch.stack(ss), rows, block)
    return stack(w13), stack(w2)


def _short(t) -> str:
    return (f"r{t.router_block_e}/{t.router_block_k}/{t.router_warps} "
            f"g{t.gate_up_block_n}/{t.gate_up_block_k} d{t.down_block_n}/{t.down_block_k} w{t.warps}")


if __name__ == "__main__":
    sys.exit(main())
