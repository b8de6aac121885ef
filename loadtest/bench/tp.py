"""The `tp` section: tensor parallelism at TP=2 against TP=1. On GPUs each TP engine runs in a
fresh rank-0 process, which starts its own followers: a process that ran one TP engine cannot
set up the fused all-reduce again, and a fresh one returns every byte of GPU memory. A dry run
on the CPU runs them here, its ranks over gloo."""
from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import torch

from .measure import decode_floor_ms, decode_step_ms, generate, make_engine
from .sections import equality_prompts, exact_dtype
from .shapes import config_only_dir, hf_config, random_checkpoint_dir


def tp(run) -> None:
    """Greedy tokens of each --small-models checkpoint at TP=2 (MoE: also EP=2) against TP=1 in
    float32 (float64 on the CPU), where the split sums round too little to move a token; then the last --models shape's
    decode step (overlap, the fused all-reduce) at TP=1 and TP=2."""
    args, dev, c = run.args, run.dev.type, run.need_ceilings()
    for name in run.names(args.small_models):
        ckpt = str(random_checkpoint_dir(name, run.root, run.dev))
        prompts = equality_prompts(hf_config(name).vocab_size, 6)
        dtype = str(exact_dtype(run.dev)).removeprefix("torch.")
        ref = _call(dev, greedy_tokens, dev, ckpt, dtype, 1, 1, prompts)
        for tp_size, ep in [(2, 1)] + ([(2, 2)] if "moe" in name else []):
            got = _call(dev, greedy_tokens, dev, ckpt, dtype, tp_size, ep, prompts)
            run.add("tp", f"{name} TP{tp_size}/EP{ep} == TP1 sequences", *equal_share(ref, got))
    name, batches = run.names(args.models)[-1], run.ints(args.batches)
    folder = str(config_only_dir(name, run.root))
    steps = {t: _call(dev, decode_steps, dev, folder, t, batches, args.ctx, args.steps, c.copy_gb_s) for t in (1, 2)}
    for b in batches:
        for t in (1, 2):
            ms, floor = steps[t][b]
            run.add("tp", f"{name} TP={t} B={b} step_ms", ms, f"per-rank floor {floor:.3f} ms, x{ms / floor:.2f}")
        run.add("tp", f"{name} B={b} TP2/TP1", steps[2][b][0] / steps[1][b][0], "a perfect split: 0.5")


def equal_share(ref, got) -> tuple[str, str]:
    """("same/total" sequences, the share of tokens before each sequence's first difference)."""
    same = sum(a == b for a, b in zip(ref, got))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(ref, got)) / sum(map(len, ref))
    return f"{same}/{len(ref)}", f"{100 * prefix:.1f}% of tokens before the first difference"


def greedy_tokens(device: str, ckpt: str, dtype: str, tp_size: int, ep: int, prompts) -> list[list[int]]:
    eng = make_engine(torch.device(device), ckpt, dtype=dtype, tp_size=tp_size, ep_size=ep, cuda_graph_max_bs=8,
                      kv_cache_memory=1 << 30)
    try:
        return generate(eng, prompts, 48)
    finally:
        eng.close()


def decode_steps(device: str, folder: str, tp_size: int, batches, ctx: int, steps: int,
                 copy_gb_s: float, options: dict | None = None) -> dict[int, tuple[float, float]]:
    """{batch: (step ms with overlap, per-rank floor ms)}; options: more engine options (e.g. FP8)."""
    eng = make_engine(torch.device(device), folder, load_format="dummy", tp_size=tp_size,
                      max_model_len=max(4096, 2 * ctx), cuda_graph_max_bs=max(batches), **(options or {}))
    try:
        return {b: (decode_step_ms(eng, b, ctx, steps, overlap=True), decode_floor_ms(eng, b, ctx, copy_gb_s)[0])
                for b in batches}
    finally:
        eng.close()


def _call(device: str, function, *args):
    """function(*args): in a fresh process on GPUs (a hung one is cut off by --budget-s), here on
    the CPU."""
    if device == "cpu":
        return function(*args)
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()
