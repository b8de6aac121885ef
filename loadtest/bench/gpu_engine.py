"""Engine-side measurements for `duet bench`: decode step time by batch size (graphs and
overlap on/off), prefill throughput, and the offline many-request run. Each works on an
Engine driven directly (add_request / step), so the time is what a worker loop sees:
scheduling, input building, the forward, sampling and the host round trip."""
from __future__ import annotations

import gc

import numpy as np
import torch

from .shapes import now, prefill_flops, weight_bytes_read_per_step


def make_engine(model_dir, **options):
    from shared.engine import Engine

    return Engine(model_dir=str(model_dir), **options)


def release_memory() -> None:
    """After the caller dropped its last reference (del eng): collect cycles, return memory."""
    gc.collect()
    torch.cuda.empty_cache()


def random_prompts(rng: np.random.Generator, vocab: int, lengths) -> list[list[int]]:
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lengths]


def _outputs(engine, rids) -> int:
    return sum(r.num_output for r in (engine.get(rid) for rid in rids) if r is not None)


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


def start_decoding(engine, batch: int, ctx: int, params, warm: int, seed: int = 0) -> list:
    """`batch` random prompts of `ctx` tokens added and stepped until every one decodes, then
    `warm` more steps; the GPU idle after. Their request ids (the caller drains them)."""
    rng = np.random.default_rng(seed)
    rids = [engine.add_request(p, params) for p in random_prompts(rng, engine.model_config.vocab_size, [ctx] * batch)]
    try:
        while any(engine.get(r) is not None and engine.get(r).num_output < 2 for r in rids):
            engine.step()
        for _ in range(warm):
            engine.step()
        torch.cuda.synchronize()
    except BaseException:
        _drain(engine, rids)
        raise
    return rids


def decode_step_ms(engine, batch: int, ctx: int, steps: int, warm: int = 8, *, graphs: bool = True,
                   overlap: bool = False, seed: int = 0) -> float:
    """Median-free plain mean over `steps` engine steps once every request decodes."""
    from shared.engine import SamplingParams

    g = engine.runner.graphs
    if g is not None:
        g.capture = graphs and bool(g.graphs)
    _set_overlap(engine, overlap)
    # prompts prefill over several steps (the step's token budget): the first ones decode that
    # many steps early, and must not reach max_tokens inside the timed window
    stagger = -(-batch * ctx // engine.scheduler.max_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8 + stagger, ignore_eos=True)
    rids: list = []
    try:
        rids = start_decoding(engine, batch, ctx, params, warm, seed)
        before = _outputs(engine, rids)
        t0 = now()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ms = (now() - t0) / steps * 1e3
        decoded = _outputs(engine, rids) - before
    finally:
        _drain(engine, rids)
        _set_overlap(engine, False)
        if g is not None:
            g.capture = bool(g.graphs)
    # a batch some of whose sequences finished or waited (KV too small) looks faster; the overlap
    # scheduler's one step in flight moves the count by at most one step's tokens
    if decoded < batch * (steps - 1):
        raise RuntimeError(f"decode_step_ms: {decoded} tokens in {steps} steps of a batch of {batch}: not every "
                           "sequence ran every step")
    return ms


def touched_experts(engine, batch: int, ctx: int, seed: int = 0) -> list[int] | None:
    """MoE: how many of its local experts each MoE layer reads in a decode step of `batch`
    sequences at context ~ctx (None for a dense model). One eager step with the routers
    watched; the real rows only (padded graph rows are routed too, so this is a floor)."""
    from shared.engine import SamplingParams
    from shared.engine.models.moe import MoEBlock

    blocks = [m for m in engine.model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return None
    rng = np.random.default_rng(seed + 1000)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in random_prompts(rng, engine.model_config.vocab_size, [ctx] * batch)]
    while any(engine.get(r) is not None and engine.get(r).num_output < 2 for r in rids):
        engine.step()
    counts: list[int] = []

    def watch(block, args, out):
        h = args[0]
        if h.shape[0] >= batch:
            ids = torch.topk(out[:batch].float(), block.moe.top_k, dim=-1).indices
            local = block.expert_map[ids.flatten()]
            counts.append(int(torch.unique(local[local >= 0]).numel()))
    # on the block, not its router: decode batches route inside kernels/moe_decode.py
    hooks = [b.register_forward_hook(lambda mod, a, o, b=b: watch(b, a, b.gate(a[0]))) for b in blocks]
    g = engine.runner.graphs
    capture = g.capture if g is not None else None
    if g is not None:
        g.capture = False  # eager: the hooks run
    try:
        engine.step()
    finally:
        for hk in hooks:
            hk.remove()
        if g is not None:
            g.capture = capture
    _drain(engine, rids)
    return counts[-len(blocks):] if len(counts) >= len(blocks) else None


def decode_floor_ms(engine, batch: int, ctx: int, copy_gb_s: float) -> tuple[float, float]:
    """(floor ms, GB read): weights once (MoE: the experts the step's tokens route to) plus
    every sequence's KV, over copy bandwidth."""
    touched = touched_experts(engine, batch, ctx) if engine.model_config.is_moe else None
    w = weight_bytes_read_per_step(engine.model, engine.model_config.tie_word_embeddings, touched)
    kv = batch * (ctx + 16) * engine.layout.bytes_per_token
    gb = (w + kv) / 1e9
    return gb / copy_gb_s * 1e3, gb


def prefill_rate(engine, num_prompts: int, length: int, seed: int = 1) -> dict:
    """Time from queueing num_prompts prompts of `length` tokens to all first tokens."""
    from shared.engine import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, engine.model_config.vocab_size, [length] * num_prompts)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = now()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_work:
        engine.step()
    torch.cuda.synchronize()
    sec = now() - t0
    flops = prefill_flops(engine.model_config, length, num_prompts)
    return dict(prompts=num_prompts, tokens=num_prompts * length, sec=sec,
                tok_s=num_prompts * length / sec, tflops=flops / sec / 1e12)


def offline_workload(n: int, vocab: int, seed: int = 7, lo: int = 100, hi: int = 1024):
    """mini-sglang's offline bench shape: random prompt and output lengths in [lo, hi]."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(lo, hi + 1, size=n)
    outs = rng.integers(lo, hi + 1, size=n)
    return random_prompts(rng, vocab, ins), [int(o) for o in outs]


def offline_run(engine, prompts, out_lens) -> dict:
    from shared.engine import SamplingParams

    torch.cuda.synchronize()
    t0 = now()
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
            for p, o in zip(prompts, out_lens)]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            tokens[out.rid].extend(out.token_ids)
    sec = now() - t0
    produced = sum(len(v) for v in tokens.values())
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return dict(requests=len(prompts), sec=sec, out_tok_s=produced / sec,
                total_tok_s=(produced + sum(map(len, prompts))) / sec,
                tokens=[tokens[r] for r in rids])
