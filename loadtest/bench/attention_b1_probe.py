"""One-row decode attention inside the 8B decode step: stage 1's tiling and split rule swept
through the engine (graphs, PDL, overlap on), each variant its own engine (the graphs bake the
tiling in). Prints the step and attention's share of the time line (decode_timeline.py).

    python3 -m loadtest.bench.attention_b1_probe [--ctx 1024] [--variants default,bn32,...]"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

VARIANTS = {  # name: (block_n, num_warps, num_stages, min tokens a split, max splits)
    "default": (64, 4, 2, 128, 32),
    "bn32": (32, 4, 2, 128, 32),
    "bn32-split64": (32, 4, 2, 64, 64),
    "bn16-split32": (16, 4, 2, 32, 64),
    "bn64-w2": (64, 2, 2, 128, 32),
    "bn32-w2-s1": (32, 2, 1, 64, 64),
}


@contextlib.contextmanager
def variant(block_n, warps, stages, min_tokens, max_splits):
    from kernels import triton_decode_attention as tda

    saved = (tda.default_config, tda._MIN_TOKENS_PER_SPLIT, tda._MAX_SPLITS)
    tda.default_config = lambda cap, fp8: tda.DecodeConfig(block_n, warps, stages)
    tda._MIN_TOKENS_PER_SPLIT, tda._MAX_SPLITS = min_tokens, max_splits
    try:
        yield
    finally:
        tda.default_config, tda._MIN_TOKENS_PER_SPLIT, tda._MAX_SPLITS = saved


def main(argv=None) -> None:
    from .decode_timeline import decode_timeline
    from .gpu_engine import decode_step_ms, make_engine, release_memory
    from .shapes import config_only_dir

    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workdir", default="/tmp/duet-bench")
    args = p.parse_args(argv)
    model = config_only_dir("qwen3-8b", Path(args.workdir))
    rows = []
    for name in args.variants.split(","):
        with variant(*VARIANTS[name]):
            eng = make_engine(model, load_format="dummy", max_model_len=2048, cuda_graph_max_bs=8,
                              kv_cache_memory=8 << 30)
            try:
                ms = decode_step_ms(eng, 1, args.ctx, args.steps, overlap=True)
                t = decode_timeline(eng, 1, args.ctx)
                attn = sum(k.us_per_step for k in t.kernels if "decode_stage" in k.name)
                attn /= eng.model_config.num_layers
                rows.append((name, ms, attn))
                print(f"{name}: step {ms:.3f} ms, attention {attn:.1f} us a layer", flush=True)
            finally:
                eng.close()
                del eng
                release_memory()
    print("=== attention_b1_probe (bf16 8B, B=1, ctx %d) ===" % args.ctx)
    for name, ms, attn in rows:
        print(f"{name:14s} step {ms:.3f} ms  attention (stage 1 + 2) {attn:5.1f} us a layer")


if __name__ == "__main__":
    main()
