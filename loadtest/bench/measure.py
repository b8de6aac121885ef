"""Engine measurements for `duet bench`, on an Engine driven directly (add_request / step), so a
time is what a worker loop sees: scheduling, inputs, the forward, sampling, the host round trip."""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .shapes import SHAPES, config_only_dir, prefill_flops, sync, weight_bytes_read_per_step


def make_engine(device: torch.device, model_dir, **options):
    from shared.engine import Engine

    if device.type == "cpu":  # a dry run: float64 (no rounding to flip a near-tie), no graphs, a small KV pool
        options = {"device": "cpu", "dtype": "float64", "cuda_graph": False, "kv_cache_memory": 256 << 20, **options}
    return Engine(model_dir=str(model_dir), **options)


def with_engine(run, model, fn, **options):
    """fn(engine) on a fresh engine of `model` (a shape name: random weights drawn on the
    device; else a model folder), closed and its memory returned before this returns."""
    if model in SHAPES:
        model, options = config_only_dir(model, run.root), {"load_format": "dummy", **options}
    eng = make_engine(run.dev, Path(model), **options)
    try:
        return fn(eng)
    finally:
        eng.close()
        del eng
        gc.collect()
        if run.dev.type == "cuda":
            torch.cuda.empty_cache()
            if (held := torch.cuda.memory_allocated(run.dev)) > 1 << 30:  # say so: the next stack's worker
                print(f"[bench] {held / 2**30:.1f} GiB of GPU memory still allocated after the engine closed "
                      "(something still holds it); a `duet up` stack started next may find the card full",
                      file=sys.stderr, flush=True)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lengths]


def generate(engine, prompts, new_tokens, adapters: tuple[str, ...] = ()) -> list[list[int]]:
    """Greedy tokens of each prompt, ignoring EOS (new_tokens: one count, or one a prompt; the
    prompts spread over the LoRA `adapters` round robin)."""
    from shared.engine import SamplingParams

    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                               scope=_scope(adapters, i)) for i, (p, n) in enumerate(zip(prompts, counts))]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            got[out.rid] += out.token_ids
    return [got[r] for r in rids]


def _scope(adapters: tuple[str, ...], i: int):
    from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope

    return CacheScope(adapter=adapters[i % len(adapters)]) if adapters else DEFAULT_SCOPE


def _outputs(engine, rids) -> int:
    return sum(r.num_output for r in map(engine.get, rids) if r is not None)


def _drain(engine, rids) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def _set_overlap(engine, on: bool) -> None:
    from shared.engine.overlap import OverlapScheduler

    while engine.overlap is not None and engine.overlap.pending is not None:
        engine.step()
    engine.overlap = OverlapScheduler(engine) if on else None


def decode_step_ms(engine, batch: int, ctx: int, steps: int, warm: int = 8, *, graphs: bool = True,
                   overlap: bool = False, adapters: tuple[str, ...] = ()) -> float:
    """Mean ms of `steps` engine steps of `batch` sequences at context ~ctx (spread over the LoRA
    `adapters` round robin), once every one decodes and `warm` steps later."""
    from shared.engine import SamplingParams

    g = engine.runner.graphs
    if g is not None:
        g.capture = graphs and bool(g.graphs)
    _set_overlap(engine, overlap)
    # prompts prefill over several steps (the step's token budget): the first ones decode that
    # many steps early, and must not reach max_tokens inside the timed window
    stagger = -(-batch * ctx // engine.scheduler.max_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8 + stagger, ignore_eos=True)
    rids = [engine.add_request(p, params, scope=_scope(adapters, i))
            for i, p in enumerate(random_prompts(engine.model_config.vocab_size, [ctx] * batch))]
    try:
        while any(engine.get(r) is not None and engine.get(r).num_output < 2 for r in rids):
            engine.step()
        for _ in range(warm):
            engine.step()
        before = _outputs(engine, rids)
        sync(engine.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        ms = (time.perf_counter() - t0) / steps * 1e3
        decoded = _outputs(engine, rids) - before
    finally:
        _drain(engine, rids)
        _set_overlap(engine, False)
        if g is not None:
            g.capture = bool(g.graphs)
    # a batch some of whose sequences finished or waited (KV too small) would look faster; the
    # overlap scheduler's one step in flight moves the count by at most a step's tokens
    if decoded < batch * (steps - 1):
        raise RuntimeError(f"{decoded} tokens in {steps} steps of a batch of {batch}: not every sequence "
                           "ran every step")
    return ms


def decode_floor_ms(engine, batch: int, ctx: int, copy_gb_s: float) -> tuple[float, float]:
    """(floor ms, GB read): the weights once (MoE: the experts a batch's tokens route to, as
    many as uniform routing touches) and every sequence's KV, over copy bandwidth."""
    moe = engine.model_config.moe
    share = 1.0 if moe is None else 1 - (1 - moe.top_k / moe.num_experts) ** batch
    w = weight_bytes_read_per_step(engine.model, engine.model_config.tie_word_embeddings, share)
    gb = (w + batch * (ctx + 16) * engine.layout.bytes_per_token) / 1e9
    return gb / copy_gb_s * 1e3, gb


def prefill_rate(engine, num_prompts: int, length: int, seed: int = 1, adapters: tuple[str, ...] = ()) -> dict:
    """From queueing num_prompts prompts of `length` tokens (over the LoRA `adapters`) to their first tokens."""
    prompts = random_prompts(engine.model_config.vocab_size, [length] * num_prompts, seed)
    sync(engine.device)
    t0 = time.perf_counter()
    generate(engine, prompts, 1, adapters)
    sync(engine.device)
    sec = time.perf_counter() - t0
    flops = prefill_flops(engine.model_config, length, num_prompts)
    return dict(tok_s=num_prompts * length / sec, tflops=flops / sec / 1e12)
