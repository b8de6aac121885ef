"""Time a few engine steps of different shapes before a worker registers: the first fit of
its step-time model (shared/perf_model/step_model.py), off the request path.

Shapes, scaled by the step's token budget (on CPU at most 256): prefill chunks alone at two
lengths, a chunk extending a held prefix (attention over context), decode batches of one and a
few rows at a short and a long context (the long one's rows share the cached prefix, so setting
them up costs little), always; then, while the time budget lasts, many rows, decode rows with a
prompt arriving (mixed steps) and a whole step of prefill. Each step is timed to completion (a
GPU is synchronised after it); every step with a batch is one sample. Then the prefix cache and counters are reset, as after
warm-up (shared/engine/warmup.py). calibrate_once() keeps the samples for the next start
(calibration_store.py)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from services.worker_runtime.step_sampler import StepSampler
from shared.perf_model.step_model import StepShape

log = logging.getLogger("duet.worker.perf")

TIME_BUDGET_S = {"cpu": 1.0, "cuda": 5.0}


def calibrate(engine, time_budget_s: float | None = None) -> list[tuple[StepShape, float]]:
    """Timed (shape, seconds) samples; call on an idle engine before it serves."""
    from shared.engine.engine import EngineStats
    from shared.engine.sampling_params import SamplingParams

    if engine.has_work or engine.requests:
        raise RuntimeError("calibration needs an idle engine")
    gpu = engine.device.type == "cuda"
    budget_s = time_budget_s if time_budget_s is not None else TIME_BUDGET_S["cuda" if gpu else "cpu"]
    t_start = time.monotonic()
    deadline = t_start + budget_s
    sampler = StepSampler(engine.scheduler, lagged=False)
    samples: list[tuple[StepShape, float]] = []
    vocab = engine.model_config.vocab_size
    room = min(engine.max_model_len, engine.kv.capacity * engine.layout.page_size) - 16
    # shapes scale with the step's token budget; a CPU step is slow, so its shapes stay small
    scale = engine.scheduler.max_batched_tokens if gpu else min(engine.scheduler.max_batched_tokens, 256)
    many = min(engine.config.max_running_requests, 64 if gpu else 16)
    few = max(1, many // 4)
    seed = iter(range(1, 1 << 30))

    def tokens(n: int) -> list[int]:
        k = next(seed)
        return [10 + (k * 7919 + i * 104729) % max(1, min(vocab, 32000) - 20) for i in range(n)]

    def run(prompts: list[list[int]], max_tokens: int, arriving: list[int] | None = None) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        steps = 0
        while engine.has_work:
            t0 = time.perf_counter()
            engine.step()
            if gpu:
                import torch
                torch.cuda.synchronize(engine.device)
            got = sampler.sample(t0, time.perf_counter())
            if got is not None:
                samples.append(got)
            steps += 1
            if arriving is not None and steps == 2:  # rows decode now: a prompt joins them
                engine.add_request(arriving, SamplingParams(temperature=0, max_tokens=1))

    # six shapes that tell the five terms apart always run, the time budget or not; more while
    # the budget lasts. The long chunk's prompt stays cached: a held prefix for the rest
    # the rows share the prefix's pages: each needs a page or two of its own beside it
    own = few * (16 + 2 * engine.layout.page_size)
    prefix = tokens(max(16, min(scale // 2, (room - own) // 2)))
    core = [
        lambda: run([tokens(scale // 8)], 1),                              # a short chunk
        lambda: run([prefix], 1),                                          # a long chunk
        lambda: run([prefix + tokens(scale // 8)], 1),                     # a short chunk over a held prefix
        lambda: run([tokens(16)], 4),                                      # one decode row
        lambda: run([tokens(16) for _ in range(few)], 4),                  # a few rows, short context
        lambda: run([prefix + tokens(8) for _ in range(few)], 4),          # a few rows, long context
    ]
    extra = [
        (many * 24, lambda: run([tokens(16) for _ in range(many)], 4)),   # many rows
        (few * 40 + scale // 8, lambda: run([tokens(16) for _ in range(few)], 8, arriving=tokens(scale // 8))),
        (scale, lambda: run([tokens(scale)], 1)),                          # a whole step of prefill
    ]
    if len(prefix) + scale // 8 + own <= room:
        for scenario in core:
            scenario()
        for need, scenario in extra:
            if need <= room and time.monotonic() < deadline:
                scenario()
    else:  # a few odd shapes would fit five terms to noise
        log.warning("perf calibration: a KV pool of %d tokens is too small for its shapes; the step-time model "
                    "comes from live steps", room)
    engine.kv.cache.reset()
    engine.stats = EngineStats()
    engine.scheduler.num_retracted = 0
    engine.kv.check_idle()
    log.info("perf calibration: %d steps timed in %.2fs", len(samples), time.monotonic() - t_start)
    return samples


def calibrate_once(engine, perf, checkpoint: str) -> list[tuple[StepShape, float]]:
    """The samples a worker with this checkpoint, device and plan timed before (calibration_store.py),
    else calibrate() and keep them. perf: the worker's PerfModelConfig."""
    from services.worker.calibration_store import CalibrationStore, calibration_key
    from shared.model_files.default_model import default_cache_dir

    where = perf.calibration_cache
    store = CalibrationStore(None if where == "off" else Path(where) if where else default_cache_dir() / "calibration")
    key = calibration_key(engine, checkpoint)
    with store.claim(key):  # workers starting side by side: one times the steps, the rest read them
        samples = store.load(key)
        if samples:
            log.info("perf calibration: %d steps timed by an earlier start of this checkpoint, device and plan (%s)",
                     len(samples), store.root / f"{key}.json")
            return samples
        samples = calibrate(engine)
        store.save(key, samples)
    return samples
