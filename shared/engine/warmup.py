"""Run serving's kernel variants once before a worker says it is ready.

On a GPU the first request of each shape pays for Triton compiles (attention, fused MoE
and the small-batch linears pick tile configs by token count, so each bucket is its own
compile), cuBLAS heuristics and allocator growth; the first load-test run after start was
4x slower than the next. Warm-up pushes requests through the engine's own
step loop: prefill chunks at every token-count bucket up to the step budget, an extend
over a cached prefix, decode steps at the graph batch sizes, and the host sampling path
(penalties, logprobs, top-p); a prefill worker, which stops every request at its first
token, runs no decode step (engine.config.runs_decode). Then it drops what it cached and
zeroes the counters, so metrics and the prefix cache start empty. On CPU nothing compiles: one short request
checks the path."""
from __future__ import annotations

import contextlib
import logging
import time

log = logging.getLogger("duet.engine.warmup")

PREFILL_BUCKETS = (16, 64, 256, 1024, 4096, 16384)
DECODE_BATCHES = (1, 8, 32)
# prompts prefilled together: the LM head's small-batch linear has M buckets 1/2/4/8/16, so a
# step that samples 2-16 prefill rows would compile its own variant in the first traffic (a
# first run after ready an order of magnitude slower than the second)
MULTI_PREFILL = (2, 4, 8, 16)


def warm_up(engine, full: bool | None = None) -> float:
    """Seconds spent. Call before the engine serves (nothing else may be queued).
    full: every bucket (default: on GPU only)."""
    from .engine import EngineStats
    from .sampling_params import SamplingParams

    if engine.has_work or engine.requests:
        raise RuntimeError("warm-up needs an idle engine")
    t0 = time.monotonic()
    vocab = engine.model_config.vocab_size
    room = min(engine.max_model_len, engine.kv.capacity * engine.layout.page_size) - 8
    if not (engine.device.type == "cuda" if full is None else full):
        _run(engine, [[_tok(i, vocab) for i in range(8)]], SamplingParams(temperature=0, max_tokens=2))
    else:
        # LoRA: the adapters' kernels launch at every shape too (on base rows they write nothing)
        with engine.lora.step.forcing() if engine.lora is not None else contextlib.nullcontext():
            _warm_every_shape(engine, vocab, room)
    engine.kv.cache.reset()
    engine.stats = EngineStats()
    if engine.spec is not None:
        engine.spec.reset_stats()
    engine.scheduler.num_retracted = 0
    engine.kv.check_idle()
    seconds = time.monotonic() - t0
    log.info("warm-up done in %.1fs", seconds)
    return seconds


def _warm_every_shape(engine, vocab: int, room: int) -> None:
    """Every prefill bucket, an extend, several prompts a step, mixed steps, the decode batches
    (a prefill worker, which stops every request at its first token, runs no decode step)."""
    from .sampling_params import SamplingParams

    budget = engine.scheduler.max_batched_tokens
    lengths = sorted({min(n, budget, room) for n in PREFILL_BUCKETS})
    decodes = engine.config.runs_decode  # a prefill worker stops every request at its first token
    greedy = SamplingParams(temperature=0, max_tokens=3 if decodes else 1, ignore_eos=True)
    for n in lengths:  # one prompt per bucket: its chunks run alone
        _run(engine, [[_tok(n + i, vocab) for i in range(n)]], greedy)
    base = [_tok(i, vocab) for i in range(min(256, room // 2))]
    _run(engine, [base], greedy)
    _run(engine, [base + [_tok(7 * i, vocab) for i in range(32)]], greedy)  # extend over a cached prefix
    for b in MULTI_PREFILL:  # several prompts in one step: logits rows, multi-sequence attention
        _run(engine, [[_tok(97 * j + i, vocab) for i in range(min(40 + 13 * j, room))] for j in range(b)], greedy)
    host = [SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=4 if decodes else 1, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=4 if decodes else 1, logprobs=2, repetition_penalty=1.1,
                           ignore_eos=True)]
    if not decodes:  # the host sampling path of first tokens; no decode step to warm
        _run(engine, [[_tok(31 * j + i, vocab) for i in range(24)] for j in range(2)], host)
    else:
        _run_mixed(engine, vocab, room)
        graphs = engine.runner.graphs
        cap = graphs.max_bs if graphs is not None else 32
        # speculative decoding: every decode step drafts, so its verify shapes compile too
        with engine.spec.warming() if engine.spec is not None else contextlib.nullcontext():
            for b in (x for x in DECODE_BATCHES if x <= cap):
                prompts = [[_tok(31 * j + i, vocab) for i in range(24)] for j in range(b)]
                params = [greedy] * b if b > 2 else host[:b]
                _run(engine, prompts, params)


def _tok(i: int, vocab: int) -> int:
    return 10 + (i * 7919) % max(1, min(vocab, 32000) - 20)


def _run_mixed(engine, vocab: int, room: int) -> None:
    """Prompts arriving while others decode: steps that mix prefill chunks and decode rows."""
    from .sampling_params import SamplingParams

    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for j in range(2):
        engine.add_request([_tok(53 * j + i, vocab) for i in range(min(24, room - 12))], long)
    for _ in range(4):
        engine.step()
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _run(engine, [[_tok(71 * j + i, vocab) for i in range(min(60 + 9 * j, room))] for j in range(3)], short)


def _run(engine, prompts, params) -> None:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    while engine.has_work:
        engine.step()
