"""Decode step with and without programmatic dependent launch (kernels/pdl.py).

    python3 -m loadtest.bench.pdl [--model qwen3-8b] [--batches 1,8] [--prefetch 0,2,4]

One engine per variant on dummy weights of the shape (graphs on), decode step time at each
batch (context --ctx) with overlap off and on, beside the floor (weights + KV over the
measured copy bandwidth). Variants: the engine before PDL and the tuned linears (cuBLAS but
the LM head), the defaults (small-batch kernel where this GPU's sweep tuned the shape, PDL
at batch 1), the same without PDL, and the small-batch kernel on every decode linear with
PDL and each --prefetch (weight tiles pulled into L2 before a GEMV waits); deeper prefetch on
the attention linears; for MoE models, decode-kernel tilings and program orders.
Runs tests/kernels/test_pdl.py natively first (--no-tests skips). Short table last."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


DEEP = "qkv_proj=8,o_proj=8"  # the attention linears: whole weights where a program has <= 8 tiles


def _variants(prefetches: list[int]) -> list[tuple[str, dict]]:
    """(name, engine options); the option moe_tile is the bench's own (see _engine)."""
    out = [("cuBLAS linears, PDL off (before)", dict(small_batch_linear="lm_head", pdl="off")),
           ("defaults (tuned linears, PDL on)", dict(small_batch_linear="auto", pdl="on")),
           ("tuned linears, PDL off", dict(small_batch_linear="auto", pdl="off")),
           ("defaults, o_proj prefetch 8", dict(small_batch_linear="auto", pdl="on", pdl_prefetch_at="o_proj=8")),
           ("defaults, MoE experts 4 warps", dict(small_batch_linear="auto", pdl="on", moe_tile=dict(warps=4))),
           (f"all linears + PDL, {DEEP}", dict(small_batch_linear="all", pdl="on", pdl_prefetch_at=DEEP)),
           ("defaults, MoE router argmax rounds, 1 warp", dict(small_batch_linear="auto", pdl="on",
                                                                 moe_tile=dict(router_sort=False, router_warps=1))),
           ("defaults, MoE gate/up tile 16x1024 (before)",
            dict(small_batch_linear="auto", pdl="on",
                 moe_tile=dict(gate_up_block_n=16, gate_up_block_k=1024, warps=4))),
           ("defaults, MoE gate/up tile 64x128",
            dict(small_batch_linear="auto", pdl="on", moe_tile=dict(gate_up_block_n=64, gate_up_block_k=128))),
           ("defaults, MoE router top-k by one sort, 2 warps",
            dict(small_batch_linear="auto", pdl="on", moe_tile=dict(router_sort=True, router_warps=2))),
           ("defaults, MoE router argmax rounds, 2 warps (before)",
            dict(small_batch_linear="auto", pdl="on", moe_tile=dict(router_sort=False, router_warps=2)))]
    out += [(f"all linears + PDL, prefetch {p}", dict(small_batch_linear="all", pdl="on", pdl_prefetch_k_blocks=p))
            for p in prefetches]
    return out


def _engine(model_dir, make_engine, opts: dict):
    """An engine of these options; moe_tile: DecodeTile fields for the MoE blocks' decode
    kernels (set before the engine captures its graphs)."""
    opts = dict(opts)
    tile = opts.pop("moe_tile", None)
    if not tile:
        return make_engine(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", **opts)
    import dataclasses

    from shared.engine.models import moe
    plain = moe.DecodeTile
    moe.DecodeTile = lambda: dataclasses.replace(plain(), **tile)
    try:
        return make_engine(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", **opts)
    finally:
        moe.DecodeTile = plain


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefetch", default="0,1,2", help="comma-separated prefetch_k_blocks values to try")
    ap.add_argument("--only", default="", help="comma-separated variant numbers (1-based) to run")
    ap.add_argument("--no-tests", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    if not args.no_tests:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels/test_pdl.py"])
        if rc:
            return rc
    from .gpu_engine import decode_floor_ms, decode_step_ms, make_engine, release_memory
    from .shapes import config_only_dir, measure_ceilings

    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy {ceil.copy_gb_s:.0f} GB/s", flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = _variants([int(p) for p in args.prefetch.split(",") if p])
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        variants = [v for i, v in enumerate(variants, 1) if i in keep]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = config_only_dir(args.model, Path(tmp))
        floors = {}
        for name, opts in variants:
            eng = _engine(model_dir, make_engine, opts)
            if opts["pdl"] == "on" and eng.pdl is None:
                print(f"{name}: PDL not supported here", flush=True)
                del eng
                release_memory()
                continue
            for b in batches:
                if b not in floors:
                    floors[b] = decode_floor_ms(eng, b, args.ctx, ceil.copy_gb_s)[0]
                plain = decode_step_ms(eng, b, args.ctx, args.steps)
                over = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
                rows.append((name, b, plain, over, floors[b]))
                print(f"{name} B={b}: {plain:.3f} ms, overlap {over:.3f} ms, floor {floors[b]:.3f}", flush=True)
            del eng
            release_memory()
    print(f"\n{args.model}, context {args.ctx}, graphs on, {torch.cuda.get_device_name(dev)}")
    print("| variant | B | step ms | overlap ms | floor ms | x floor (overlap) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, b, plain, over, floor in rows:
        print(f"| {name} | {b} | {plain:.3f} | {over:.3f} | {floor:.3f} | {plain / floor:.2f} ({over / floor:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
