"""Does the order inside a KV page change what the attention kernels cost? (needs CUDA)

The pool is page-major either way; inside a page the engine now puts the heads outermost
([pages, kv_heads, layers, 2, page_size, head_dim], shared/engine/kv_pool.py) where it
had the layers outermost ([pages, layers, 2, kv_heads, page_size, head_dim]), so that a
worker at another tensor-parallel size writes its heads of a page as one descriptor. The
kernels read a layer through strided views, and each (page, head) [page_size, head_dim]
tile is contiguous in both orders: the prediction is no difference. This times, at a
Qwen3-8B layer's shape, one CUDA graph per order that runs the op for every layer (each
its own view of one pool), in both orders, on the same values:
- decode attention (the engine's launch, auto splits) at batch 1 and 32, 1k and 4k context;
- prefill attention of one 2048-token chunk after a 2048-token prefix;
- the KV store of a decode step's tokens.
Outputs of the two orders must be equal to the bit (the same values in other places).

    python3 -m loadtest.bench.kv_page_order_probe [--kv-dtype bf16,fp8] [--layers 36]
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

H_Q, H_KV, HEAD_DIM, PAGE = 32, 8, 128, 16


def orders(pages: int, layers: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, tuple]:
    """The same values in both page orders; (pool, layer -> (k view, v view))."""
    head_major = torch.randn((pages, H_KV, layers, 2, PAGE, HEAD_DIM), device="cuda", generator=gen,
                             dtype=torch.bfloat16).mul_(0.5).to(dtype)  # 16-bit draws: 4k x 32 fits twice
    layer_major = head_major.permute(0, 2, 3, 1, 4, 5).contiguous()
    return {"layer-major": (layer_major, lambda i: (layer_major[:, i, 0], layer_major[:, i, 1])),
            "head-major": (head_major, lambda i: (head_major[:, :, i, 0], head_major[:, :, i, 1]))}


def timed_us(fn, layers: int) -> float:
    import triton.testing

    from loadtest.bench.kernels import capture_graph
    graph = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / layers


def decode_case(batch: int, ctx: int, layers: int, dtype, gen) -> list[tuple]:
    from kernels.triton_decode_attention import launch_decode_attention
    per_seq = ctx // PAGE
    pools = orders(batch * per_seq + 1, layers, dtype, gen)
    table = (torch.randperm(batch * per_seq, device="cuda", generator=gen) + 1).view(batch, per_seq).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, H_Q, HEAD_DIM), device="cuda", generator=gen).bfloat16()
    rows = {}
    for name, (_, view) in pools.items():
        out = torch.empty_like(q)

        def run(view=view, out=out):
            for i in range(layers):
                launch_decode_attention(q, *view(i), table, lens, 1 / math.sqrt(HEAD_DIM), out=out)
        rows[name] = (timed_us(run, layers), out)
    return [(f"decode attention B={batch} ctx={ctx}", rows)]


def extend_case(prefix: int, chunk: int, layers: int, dtype, gen) -> list[tuple]:
    from kernels.triton_extend_attention import launch_extend_attention
    per_seq = (prefix + chunk) // PAGE
    pools = orders(per_seq + 1, layers, dtype, gen)
    table = (torch.randperm(per_seq, device="cuda", generator=gen) + 1).view(1, per_seq).int()
    lens = torch.tensor([prefix + chunk], dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    q = torch.randn((chunk, H_Q, HEAD_DIM), device="cuda", generator=gen).bfloat16()
    rows = {}
    for name, (_, view) in pools.items():
        out = torch.empty_like(q)

        def run(view=view, out=out):
            for i in range(layers):
                launch_extend_attention(q, *view(i), table, indptr, lens, 1 / math.sqrt(HEAD_DIM), chunk, out=out)
        rows[name] = (timed_us(run, layers), out)
    return [(f"prefill attention {chunk} after {prefix}", rows)]


def store_case(batch: int, layers: int, dtype, gen) -> list[tuple]:
    from kernels.triton_store_kv import launch_store_kv
    pools = orders(4 * batch + 1, layers, dtype, gen)
    k = torch.randn((batch, H_KV, HEAD_DIM), device="cuda", generator=gen).bfloat16()
    slots = (torch.randperm(4 * batch * PAGE, device="cuda", generator=gen)[:batch] + PAGE).int()
    rows = {}
    for name, (pool, view) in pools.items():
        def run(view=view):
            for i in range(layers):
                launch_store_kv(*view(i), k, k, slots)
        rows[name] = (timed_us(run, layers), view(layers - 1)[0])
    return [(f"store K/V of {batch} tokens", rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m loadtest.bench.kv_page_order_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtype", default="bf16,fp8")
    p.add_argument("--layers", type=int, default=36)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from kernels.fp8 import FP8_DTYPE
    table = []
    for kv in a.kv_dtype.split(","):
        dtype = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}[kv]
        gen = torch.Generator(device="cuda").manual_seed(0)
        cases = []
        for batch, ctx in ((1, 1024), (32, 1024), (1, 4096), (32, 4096)):
            cases += decode_case(batch, ctx, a.layers, dtype, gen)
        if kv == "bf16":
            cases += extend_case(2048, 2048, a.layers, dtype, gen)
        cases += store_case(32, a.layers, dtype, gen)
        for name, rows in cases:
            (t_old, o_old), (t_new, o_new) = rows["layer-major"], rows["head-major"]
            same = torch.equal(o_old.view(torch.uint8), o_new.view(torch.uint8)) if o_old.dtype == FP8_DTYPE \
                else torch.equal(o_old, o_new)
            table.append((kv, name, t_old, t_new, same))
        torch.cuda.empty_cache()
    print(f"\n=== KV page order ({torch.cuda.get_device_name()}), us a layer, CUDA graphs of {a.layers} layers ===")
    print(f"{'KV':<5}{'op':<36}{'layer-major':>12}{'head-major':>12}{'ratio':>8}  equal")
    for kv, name, t_old, t_new, same in table:
        print(f"{kv:<5}{name:<36}{t_old:>12.2f}{t_new:>12.2f}{t_new / t_old:>8.3f}  {same}")
    return 0 if all(r[-1] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
