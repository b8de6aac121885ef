"""Fused MoE kernel on the device: time, floors, tile sweep (Qwen3-30B-A3B shapes).

    python3 -m loadtest.bench.moe_kernel [--sweep] [--m 1,8,32] [--shapes full,tp2,ep2]
    TRITON_INTERPRET=1 python -m loadtest.bench.moe_kernel --smoke --sweep   # CPU: checks the script

Shapes: 128 experts, top-8, hidden 2048, expert intermediate 768, bf16 ("full"); its TP=2
shard (intermediate 384) and EP=2 share (64 local experts, expert map). For each token
count M (random routing): CUDA-graph replay time with L2 flushed before each replay (what
decode runs), the bytes floor (the experts the batch touches, read once, plus activations)
over the copy bandwidth measured in the same run, the flops floor over the matmul rate,
GB/s, and relative error against the torch reference; beside it the torch loop over
touched experts (the CPU path; eager). --sweep tries a grid of tiles per M and prints the
best as lines to paste into kernels/fused_moe_config.py TUNED. Short table last."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

SHAPES = {"full": (128, 2048, 768, 8, None), "tp2": (128, 2048, 384, 8, None), "ep2": (128, 2048, 768, 8, 64)}
SMOKE_SHAPES = {"full": (8, 64, 32, 2, None), "ep2": (8, 64, 32, 2, 4)}


@dataclass
class Row:
    shape: str
    m: int
    experts_touched: int
    ms: float
    floor_ms: float
    gb_s: float
    tflop_s: float
    relerr: float
    torch_loop_ms: float
    config: str


def _inputs(m, e, h, i, k, local, dtype, dev, gen):
    x = torch.randn(m, h, generator=gen).to(dev, dtype)
    n_local = local or e
    w13 = (torch.randn(n_local, 2 * i, h, generator=gen) / h ** 0.5).to(dev, dtype)
    w2 = (torch.randn(n_local, h, i, generator=gen) / i ** 0.5).to(dev, dtype)
    ids = torch.rand(m, e, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(m, k, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    emap = None
    if local:
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[:local] = torch.arange(local, dtype=torch.int32)
        emap = emap.to(dev)
    return x, w13, w2, w.to(dev), ids.to(dev), emap


def _touched(ids, emap, local) -> int:
    e = ids.flatten().long()
    if emap is not None:
        e = emap.long()[e]
    return int(torch.unique(e[e >= 0]).numel())


def _torch_loop(x, w13, w2, w, ids, emap):
    from kernels.fused_moe import fused_moe_reference
    return fused_moe_reference(x, w13, w2, w, ids, expert_map=emap)


def sweep_tiles(m: int):
    """A modest grid per token count (the two GEMMs are tuned one after the other)."""
    from kernels.fused_moe_config import GemmTile
    if m <= 32:
        grid = [(16, bn, bk, 1, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4)]
    elif m <= 256:
        grid = [(bm, bn, 64, 4, 4, st) for bm in (16, 32, 64) for bn in (64, 128) for st in (3, 4)]
    else:
        grid = [(bm, bn, 64, 8, w, 3) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)]
    return [GemmTile(*t) for t in grid]


def main(argv=None) -> int:
    from kernels.fused_moe import fused_moe
    from kernels.fused_moe_config import MoEConfig, bucket, get_config

    from .kernels import BenchConfig, bench, bench_replay, copy_bandwidth, matmul_rate

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.moe_kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192")
    p.add_argument("--shapes", default="full,tp2,ep2")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-m", default="1,8,32,128,1024,4096", help="token counts the sweep tunes")
    p.add_argument("--sweep-limit", type=int, default=0, help="at most this many tiles per M (0: all)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", default=os.path.join(os.environ["OUT"], "moe_kernel.json") if os.environ.get("OUT") else None)
    a = p.parse_args(argv)
    cfg = BenchConfig.smoke() if a.smoke else BenchConfig()
    if cfg.device != "cuda" and not a.smoke:
        print("moe_kernel needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dev, dtype = cfg.device, (torch.float32 if a.smoke else torch.bfloat16)
    copy = copy_bandwidth(cfg)
    flops_peak = matmul_rate(cfg)
    print(f"copy {copy / 1e9:.0f} GB/s, matmul {flops_peak / 1e12:.0f} TFLOP/s", flush=True)
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    ms_list = [1, 3, 17] if a.smoke else [int(x) for x in a.m.split(",")]
    rows: list[Row] = []
    best: dict[tuple, dict[int, tuple]] = {}
    gen = torch.Generator().manual_seed(0)
    for name in [s for s in a.shapes.split(",") if s in shapes]:
        e, h, i, k, local = shapes[name]
        for m in ms_list:
            x, w13, w2, w, ids, emap = _inputs(m, e, h, i, k, local, dtype, dev, gen)
            out = torch.empty_like(x)
            conf = get_config(m, e, h, i, k, str(dtype).removeprefix("torch."))
            ms = bench_replay(cfg, lambda: fused_moe(x, w13, w2, w, ids, expert_map=emap, out=out, config=conf))
            ref = _torch_loop(x, w13, w2, w, ids, emap)
            from loadtest.bench.accuracy import relative_error
            err = relative_error(fused_moe(x, w13, w2, w, ids, expert_map=emap), ref)
            touched = _touched(ids, emap, local)
            nbytes = touched * 3 * h * i * x.element_size() + 2 * x.numel() * x.element_size()
            flops = 2 * m * k * 3 * h * i * (local or e) / e
            floor = max(nbytes / copy, flops / flops_peak) * 1e3
            loop_ms = bench(cfg, lambda: _torch_loop(x, w13, w2, w, ids, emap)) if m <= 256 else float("nan")
            rows.append(Row(name, m, touched, ms, floor, nbytes / ms / 1e6, flops / ms / 1e9, err, loop_ms,
                            str(conf)))
            print(f"{name} M={m}: {ms:.4f} ms, floor {floor:.4f} (x{ms / floor:.2f}), {nbytes / ms / 1e6:.0f} GB/s, "
                  f"relerr {err:.1e}, torch loop {loop_ms:.3f} ms", flush=True)
            if a.sweep and (a.smoke or m in {int(v) for v in a.sweep_m.split(",")}):
                tiles = sweep_tiles(m)
                if a.sweep_limit or a.smoke:
                    tiles = tiles[:a.sweep_limit or 2]

                def timed(c):
                    try:
                        return bench_replay(cfg, lambda: fused_moe(x, w13, w2, w, ids, expert_map=emap, out=out,
                                                                   config=c))
                    except Exception as ex:  # noqa: BLE001 - a tile that does not compile
                        print(f"  skip {c}: {type(ex).__name__}", flush=True)
                        return float("inf")
                # gate/up first (down at the default), then down with the best gate/up of the same block_m
                gu_times = [(timed(MoEConfig(t, t if t.block_m != conf.block_m else conf.down)), t) for t in tiles]
                t_gu, best_gu = min(gu_times, key=lambda r: r[0])
                results = [(timed(MoEConfig(best_gu, t)), MoEConfig(best_gu, t)) for t in tiles
                           if t.block_m == best_gu.block_m]
                results.append((t_gu, MoEConfig(best_gu, best_gu)))
                results = [r for r in results if r[0] != float("inf")]
                if results:
                    t, c = min(results, key=lambda r: r[0])
                    best.setdefault((e, h, i, k, str(dtype).removeprefix("torch.")), {})[bucket(m)] = (t, c)
                    print(f"  best M={m}: {t:.4f} ms (default {ms:.4f}) {c}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(copy_gb_s=copy / 1e9, matmul_tflops=flops_peak / 1e12, rows=[asdict(r) for r in rows],
                           best={str(k): {b: (t, str(c)) for b, (t, c) in v.items()} for k, v in best.items()}), f,
                      indent=1)
    if best:
        print("\n# paste into kernels/fused_moe_config.py TUNED")
        for key, table in best.items():
            print(f"TUNED[{key!r}] = {{")
            for b, (t, c) in sorted(table.items()):
                print(f"    {b}: {c!r},  # {t:.4f} ms")
            print("}")
    print("\n=== moe_kernel ===")
    print(f"{'shape':<6}{'M':>6}{'touched':>8}{'ms':>9}{'floor':>9}{'x':>6}{'GB/s':>7}{'TFLOP/s':>8}{'relerr':>9}"
          f"{'loop ms':>9}")
    for r in rows:
        print(f"{r.shape:<6}{r.m:>6}{r.experts_touched:>8}{r.ms:>9.4f}{r.floor_ms:>9.4f}{r.ms / r.floor_ms:>6.2f}"
              f"{r.gb_s:>7.0f}{r.tflop_s:>8.1f}{r.relerr:>9.1e}{r.torch_loop_ms:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
