"""The `tp_fp8` section: FP8 weights, an FP8 KV cache and the host KV tier under TP=2 against
TP=1, each engine in a fresh process on GPUs as in the `tp` section (tp.py).

Greedy tokens are compared where TP=1 and TP=2 round alike: float32 compute (float64 on the CPU).
FP8 weights go through the W8A16 kernels there (--fp8-decode-gemm off, steps of at most 4 tokens,
one prompt at a time: the dense and MoE W8A8 routes quantize activations, and a split partial sum
that moves one activation across an FP8 step changes the rest of a random model's sequence:
docs/performance/tp.md). On the CPU FP8 weights are dequantized at load, so the row compares the
FP8-rounded model. The host tier row pushes a first round of prompts out of a small device pool
with other prompts, then sends their prefixes again: the prefix comes back from the host tier."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .measure import generate, make_engine, random_prompts
from .sections import FP8, FP8_KV, equality_prompts, exact_dtype
from .shapes import config_only_dir, hf_config, random_checkpoint_dir
from .tp import _call, decode_steps, equal_share

PAGE = 16
HOST_POOL_PAGES = 24  # device pool of the host-tier row: two of its prompts at a time, not a round's four
FP8_WEIGHTS = dict(quantization="fp8", fp8_decode_gemm="off", max_num_batched_tokens=4)  # W8A16 throughout
STEP_VARIANTS = (("fp8", FP8), ("fp8+fp8kv", FP8_KV))


def tp_fp8(run) -> None:
    """Per --small-models checkpoint: greedy tokens at TP=2 against TP=1 with an FP8 KV cache, with
    FP8 weights, and with the host tier loading evicted prefixes back; then the last --models
    shape's decode step at TP=1 and TP=2 with FP8 weights, and with FP8 weights and FP8 KV."""
    args, dev, c = run.args, run.dev.type, run.need_ceilings()
    dtype = str(exact_dtype(run.dev)).removeprefix("torch.")
    for name in run.names(args.small_models):
        ckpt = str(random_checkpoint_dir(name, run.root, run.dev))
        prompts = equality_prompts(hf_config(name).vocab_size, 6)
        host_rounds, host_options = host_tier_case(name, dtype)
        cases = (("fp8 KV", [prompts], 48, dict(kv_cache_dtype="fp8_e4m3"), ""),
                 ("fp8 weights", [[p] for p in prompts], 48, FP8_WEIGHTS,
                  ", W8A16 (--fp8-decode-gemm off, steps of <= 4 tokens, one prompt at a time)" * (dev == "cuda")),
                 ("host tier", host_rounds, 16, host_options, ", write-back policy all"))
        for label, rounds, new_tokens, options, how in cases:
            (ref, info1), (got, info2) = (_call(dev, rounds_tokens, dev, ckpt, dtype, t, rounds, new_tokens, options)
                                          for t in (1, 2))
            same, share = equal_share(ref, got)
            run.add("tp_fp8", f"{name} {label} TP2 == TP1 sequences", same,
                    f"{share}; {dtype} compute, {info2.text}{how}")
            if label == "host tier":
                run.add("tp_fp8", f"{name} host tier TP1 / TP2 host-hit tokens", f"{info1.host} / {info2.host}",
                        f"of {info1.cached} / {info2.cached} cached prompt tokens; prefixes of round 1 evicted "
                        "by round 2, sent again in round 3")
    name, batches = run.names(args.models)[-1], run.ints(args.batches)
    if not batches:  # --batches "": the tokens alone (--small-models "": the steps alone)
        return
    folder = str(config_only_dir(name, run.root))
    for tag, options in STEP_VARIANTS:
        steps = {t: _call(dev, decode_steps, dev, folder, t, batches, args.ctx, args.steps, c.copy_gb_s, options)
                 for t in (1, 2)}
        for b in batches:
            for t in (1, 2):
                ms, floor = steps[t][b]
                run.add("tp_fp8", f"{name} {tag} TP={t} B={b} step_ms", ms,
                        f"per-rank floor {floor:.3f} ms, x{ms / floor:.2f}")
            run.add("tp_fp8", f"{name} {tag} B={b} TP2/TP1", steps[2][b][0] / steps[1][b][0], "a perfect split: 0.5")


def host_tier_case(name: str, dtype: str) -> tuple[list[list[list[int]]], dict]:
    """(rounds of prompts, engine options): four prompts of a 6-page prefix and a short tail,
    four longer others that evict them from a HOST_POOL_PAGES device pool, then the four
    prefixes again with other tails. Every page leaving the device is written back (policy
    `all`): the prompts are new, so the default policy would copy none of them."""
    cfg = hf_config(name)
    prefixes = random_prompts(cfg.vocab_size, [6 * PAGE] * 4, seed=11)
    tails = [random_prompts(cfg.vocab_size, [PAGE] * 4, seed=s) for s in (12, 13)]
    others = random_prompts(cfg.vocab_size, [10 * PAGE] * 4, seed=14)
    rounds = [[p + t for p, t in zip(prefixes, tails[0])], others, [p + t for p, t in zip(prefixes, tails[1])]]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * PAGE * \
        torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return rounds, dict(page_size=PAGE, kv_pages=HOST_POOL_PAGES * page_bytes, kv_host_memory=160 * page_bytes,
                        host_write_policy="all")


@dataclass
class TierInfo:
    """What the engine ran with (for the row's text), and its prompt tokens served from cache."""

    text: str
    host: int  # of them, loaded back from the host tier
    cached: int


def rounds_tokens(device: str, ckpt: str, dtype: str, tp_size: int, rounds, new_tokens: int,
                  options: dict) -> tuple[list[list[int]], TierInfo]:
    """Greedy tokens of every prompt, the rounds one after another on one engine, and what the
    engine ran with. kv_pages: the whole pool's bytes at TP=1 (a rank holds its share, so
    both sizes hold as many pages); host_write_policy: the host tier's write-back policy."""
    from shared.engine.kv_write_policy import HostTierWrites

    options = dict(options)
    if "kv_pages" in options:
        options["kv_cache_memory"] = options.pop("kv_pages") // tp_size
    if "host_write_policy" in options:
        options["host_writes"] = HostTierWrites(policy=options.pop("host_write_policy"))
    eng = make_engine(torch.device(device), ckpt, dtype=dtype, tp_size=tp_size, cuda_graph_max_bs=8,
                      **{"kv_cache_memory": 1 << 30, **options})
    try:
        locked = host_tier_locked(eng)
        tokens = [seq for prompts in rounds for seq in generate(eng, prompts, new_tokens)]
        return tokens, TierInfo(f"weights {eng.weights_description}, KV {str(eng.kv_dtype).removeprefix('torch.')}"
                                f" ({eng.layout.num_pages} pages a rank{locked})", eng.stats.host_cached_tokens,
                                eng.stats.cached_tokens)
    finally:
        eng.close()


def host_tier_locked(eng, timeout_s: float = 120.0, still_s: float = 5.0) -> str:
    """Wait until every host-tier page is usable (on GPUs they join as every rank page-locks them
    in the background: rounds run at once evicted into a tier of no pages, 0 / 0 host-hit tokens
    on two H200s, likely so); say so where some are not. Stops when locking failed, or rank 0's
    ended and the usable pages (the least any rank locked) stopped growing for `still_s`."""
    tier = getattr(eng.kv.cache, "host", None)
    if tier is None or tier.pinner is None:
        return ""
    until = time.monotonic() + timeout_s
    tier.pinner.wait(timeout_s)
    seen, since = -1, time.monotonic()
    while tier.capacity < tier.num_pages and time.monotonic() < until and not tier.pinner.failed:
        tier.poll()
        if tier.capacity != seen:
            seen, since = tier.capacity, time.monotonic()
        elif tier.pinner.done.is_set() and time.monotonic() - since > still_s:
            break
        time.sleep(0.05)
    short = tier.capacity < tier.num_pages
    return f", host tier {tier.capacity} of {tier.num_pages} pages locked" if short else ""
