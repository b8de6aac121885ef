"""Decode attention at long context (needs CUDA): one layer of Qwen3-8B's attention (32 q heads,
8 kv heads, head dim 128, 16-token pages) over B sequences of 16k tokens, bf16 and FP8 pages, for
split counts and stage-1 tilings: us per call in a CUDA graph, GB/s of KV read against the copy
bandwidth. A layer's KV (0.5-2 GB) is far past L2, as in a decode step. The engine's split rule
(kernels/triton_decode_attention.py choose_num_kv_splits) is the "default" column.

    python3 -m loadtest.bench.decode_attention_long [--batches 16,32] [--ctx 16384]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

H_Q, H_KV, D, PAGE = 32, 8, 128, 16


def main(argv=None) -> int:
    from kernels.triton_decode_attention import (DecodeConfig, _num_sms, choose_num_kv_splits,
                                                 launch_decode_attention)
    from .small_batch_linear import Setup, copy_bandwidth, graph_replay_ms

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.decode_attention_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,32")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--splits", default="default,8,16,32")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    copy = copy_bandwidth(Setup.for_device())
    print(f"device {torch.cuda.get_device_name(0)}; copy {copy / 1e12:.2f} TB/s", flush=True)
    configs = [DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 2), DecodeConfig(128, 8, 3)]
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        pages_per_seq = -(-args.ctx // PAGE)
        num_pages = batch * pages_per_seq
        page_table = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages_per_seq)
        seq_lens = torch.full((batch,), args.ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, H_Q, D, device="cuda", generator=gen).to(torch.bfloat16)
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k = torch.randn(num_pages, H_KV, PAGE, D, device="cuda", generator=gen).to(kv_dtype)
            v = torch.randn(num_pages, H_KV, PAGE, D, device="cuda", generator=gen).to(kv_dtype)
            nbytes = 2 * k.numel() * k.element_size()
            default = choose_num_kv_splits(batch, H_KV, pages_per_seq * PAGE, _num_sms(q.device))
            out = torch.empty_like(q)
            for cfg in configs:
                cells = []
                for sp in args.splits.split(","):
                    splits = default if sp == "default" else int(sp)
                    fn = lambda: launch_decode_attention(q, k, v, page_table, seq_lens, 1 / math.sqrt(D),  # noqa: E731
                                                         num_kv_splits=splits, out=out, config=cfg)
                    try:
                        us = graph_replay_ms([fn], 10) * 1e3
                    except Exception as e:  # noqa: BLE001 - a tiling that does not fit is skipped
                        print(f"  {cfg} splits={splits} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                        continue
                    cells.append((sp, splits, us))
                    rows.append((batch, str(kv_dtype).removeprefix("torch."), cfg, sp, splits, us, nbytes / us / 1e3))
                print(f"B={batch} {kv_dtype} {cfg}: " + "  ".join(f"{sp}({s}) {us:.0f} us" for sp, s, us in cells),
                      flush=True)
            del k, v
            torch.cuda.empty_cache()
    print(f"\n=== decode_attention_long: ctx {args.ctx}, one layer, copy {copy / 1e12:.2f} TB/s, {time.time() - t0:.0f} s ===")
    print(f"{'B':>3} {'kv':<14}{'block_n/warps/stages':<22}{'splits':>12}{'us':>9}{'GB/s':>7}{'%copy':>6}")
    for batch, kv, cfg, sp, splits, us, gbs in rows:
        print(f"{batch:>3} {kv:<14}{f'{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}':<22}{f'{sp}({splits})':>12}"
              f"{us:9.1f}{gbs:7.0f}{100 * gbs * 1e9 / copy:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
