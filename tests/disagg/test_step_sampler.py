"""The step timer under overlap scheduling (services/worker_runtime/step_sampler.py) on a real
engine (tiny model, CPU, overlap on): a timing sample closes only where the host saw the device
finish a batch (the overlap scheduler's settle points), covers every batch launched since the
last one exactly once, and a call that launched a chunk mid-prompt (sampling nothing, waiting
for nothing) closes none. Run on the CPU the lagged timer's windows are not the CPU's step times
(a CPU worker times each call); what is checked is which batches each window holds and where
it ends."""
from __future__ import annotations

import time

import pytest

from services.worker_runtime.step_sampler import StepSampler
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import build_model_dir, kv_bytes_for_pages

pytestmark = pytest.mark.usefixtures("torch_one_thread")
CHUNK = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("sampler") / "m", "llama_tied_gqa2", seed=52)
    e = Engine(model_dir=str(d), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=CHUNK,
               kv_cache_memory=kv_bytes_for_pages(d, 200, 4, elem_bytes=4))
    assert e.overlap is not None, "the engine's default plan overlaps steps"
    return e


def run(engine, sampler, requests):
    """Steps until idle; per call: (the batch it launched or None, the sample it closed or None)."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    calls = []
    while engine.has_work:
        seen = engine.scheduler.num_batches
        t0 = time.perf_counter()
        engine.step()
        sample = sampler.sample(t0, time.perf_counter())
        batch = engine.scheduler.last_batch if engine.scheduler.num_batches != seen else None
        calls.append((batch, sample))
    engine.kv.check_idle()
    return calls


def test_a_window_closes_only_at_a_settled_batch_and_holds_each_batch_once(engine):
    sampler = StepSampler(engine.scheduler, lagged=True, overlap=engine.overlap)
    prompt = list(range(5, 5 + 3 * CHUNK + 5))  # four chunks: three sample nothing
    calls = run(engine, sampler, [(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])
    batches = [b for b, _ in calls if b is not None]
    samples = [s for _, s in calls if s is not None]
    # the chunks mid-prompt waited for nothing: no sample until the prompt's first token was read back
    first = next(i for i, (_, s) in enumerate(calls) if s is not None)
    assert first >= 4 and all(s is None for _, s in calls[:first])
    shape, seconds = calls[first][1]
    assert shape.steps == 4 and shape.prefill_tokens == len(prompt) and shape.decode_rows == 0, shape
    assert seconds > 0
    # each later window is one batch (steady decoding settles the previous call's batch)
    assert all(s.steps == 1 and s.decode_rows == 1 for s, _ in samples[1:])
    # every batch is in exactly one window, but the last one (launched; its settle is the next call's)
    covered = sum(s.steps for s, _ in samples)
    assert covered + len(sampler._open) == len(batches)
    assert sum(s.decode_rows for s, _ in samples) + sum(x.shape.decode_rows for x in sampler._open) == \
        sum(1 for b in batches for it in b.items if it.start >= it.req.num_prompt)


def test_host_side_sampling_settles_its_own_batch(engine):
    # logprobs sample on the host: the call waits for its own batch, and the window ends there
    sampler = StepSampler(engine.scheduler, lagged=True, overlap=engine.overlap)
    settled_before = engine.overlap.settled_batch
    calls = run(engine, sampler, [(list(range(7, 7 + CHUNK - 2)),
                                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1))])
    assert engine.overlap.settled_batch == engine.scheduler.num_batches > settled_before
    assert not sampler._open  # nothing launched is left outside a window
    assert [s[0].steps for _, s in calls if s is not None] == [1] * sum(1 for b, _ in calls if b is not None)
