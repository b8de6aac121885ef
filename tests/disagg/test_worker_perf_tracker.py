"""The worker's side of the step-time model on a real engine (tiny model): calibration times
shapes that tell the terms apart, every step is sampled, a refit reaches the registry entry
and the scheduler's inter-token budget, a prefill worker's handoffs fit its transfer model.
Nothing here asserts a speed: only what is measured and where it goes."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from services.worker.calibration_store import calibration_key
from services.worker.perf_calibration import calibrate, calibrate_once
from services.worker_runtime.perf_tracker import PerfTracker, handoff_totals
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.perf_model.config import ItlTarget, PerfModelConfig, TtftTarget
from shared.perf_model.step_model import StepModel
from shared.perf_model.worker_perf import WorkerPerf
from shared.telemetry.metrics import DuetMetrics
from tests.helpers.engine_models import build_model_dir, kv_bytes_for_pages, random_prompts

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("perf") / "m", "llama_tied_gqa2", seed=51)
    return Engine(model_dir=str(d), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=128,
                  kv_cache_memory=kv_bytes_for_pages(d, 600, 4, elem_bytes=4))


def drive(engine, tracker: PerfTracker, prompts, max_tokens: int) -> None:
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_work:
        t0 = time.perf_counter()
        engine.step()
        tracker.on_step(t0, time.perf_counter())


def test_calibration_covers_every_term_and_leaves_the_engine_clean(engine):
    samples = calibrate(engine, time_budget_s=0.0)  # the core shapes run whatever the budget
    shapes = [s for s, _ in samples]
    assert all(seconds > 0 for _, seconds in samples)
    assert {s.prefill_tokens for s in shapes if not s.decode_rows} >= {16, 64}       # two chunk lengths
    assert any(s.attended_pairs > s.prefill_tokens * 40 for s in shapes)             # a chunk over a prefix
    assert {s.decode_rows for s in shapes if not s.prefill_tokens} >= {1, 4}          # rows ...
    contexts = sorted(s.decode_context / s.decode_rows for s in shapes if s.decode_rows == 4)
    assert contexts[-1] > 4 * contexts[0]                                              # ... at two contexts
    assert engine.stats.steps == 0 and not engine.requests
    engine.kv.check_idle()


def test_a_second_start_reuses_the_calibration_its_checkpoint_device_and_plan_timed(engine, tmp_path):
    perf = PerfModelConfig(calibration_cache=str(tmp_path))
    first = calibrate_once(engine, perf, checkpoint="aaaa")
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and first
    # read back, not timed again (timings never repeat to the last bit)
    assert calibrate_once(engine, perf, checkpoint="aaaa") == first
    assert calibration_key(engine, "bbbb") != calibration_key(engine, "aaaa")  # other weights: timed again
    files[0].write_text("{not json")  # a torn or foreign file is ignored and rewritten
    again = calibrate_once(engine, perf, checkpoint="aaaa")
    assert again and again != first and len(list(tmp_path.glob("*.json"))) == 1
    off = PerfModelConfig(calibration_cache="off")
    assert calibrate_once(engine, off, checkpoint="cccc") and len(list(tmp_path.glob("*.json"))) == 1


def test_live_steps_refit_the_model_the_budget_and_the_registry_use(engine):
    perf = WorkerPerf()
    registry = CollectorRegistry()
    config = PerfModelConfig(calibrate=False, budget_floor_tokens=8, slo=ItlTarget(itl_ms=40.0))
    tracker = PerfTracker(engine, perf, config, registry)
    assert engine.scheduler.itl_budget is tracker.budget
    assert (perf.itl_target_s, perf.budget_floor_tokens) == (0.040, 8)
    assert perf.budget_graph_rows == tracker.budget.graph_rows == -1  # CPU: no graphs, sliced at any rows
    assert perf.budget_graph_tokens == tracker.budget.graph_tokens == 0
    assert (perf.budget_row_tokens, perf.budget_spec_rows) == (1, 0)  # no speculation: a decode row is one token
    drive(engine, tracker, random_prompts(1, [20], seed=52), 3)
    tracker.refit()
    assert perf.step is None  # uncalibrated, too few steps of each kind yet: nothing to publish
    for k in range(5):
        drive(engine, tracker, random_prompts(2, [9 + k, 30 - k], seed=53 + k), 4)
    tracker.refit()
    assert perf.step is not None and tracker.budget.model is perf.step
    assert perf.step.samples == tracker.fit.count >= 10
    value = registry.get_sample_value
    assert value("duet_engine_step_seconds_count", {"phase": "prefill"}) >= 2
    assert value("duet_engine_step_seconds_count", {"phase": "decode"}) >= 5
    assert value("duet_engine_step_model_error_ratio") == perf.step.rel_error
    published = perf.step.to_dict()  # the coefficients as the registry entry carries them
    for term in ("base_s", "prefill_token_s", "attended_pair_s", "decode_row_s", "context_token_s"):
        assert value("duet_engine_step_model_coefficient", {"term": term}) == published[term]
    assert published["base_s"] > 0
    # in natural units: seconds a step, and a prompt token (the fit's feature is per thousand)
    assert value("duet_engine_step_model_coefficient", {"term": "base_s"}) == pytest.approx(perf.step.coef[0])
    assert value("duet_engine_step_model_coefficient", {"term": "prefill_token_s"}) == \
        pytest.approx(perf.step.coef[1] / 1000)
    engine.scheduler.itl_budget = None


def test_the_first_token_target_reaches_the_budget_and_the_steps_it_widened_are_counted(engine):
    off = PerfModelConfig(calibrate=False, budget_ttft=False, ttft=TtftTarget(ttft_ms=550.0))
    assert PerfTracker(engine, WorkerPerf(), off, CollectorRegistry()).budget.ttft_s == 0.0
    assert PerfTracker(engine, WorkerPerf(), PerfModelConfig(calibrate=False), CollectorRegistry()).budget.ttft_s \
        == 5.0  # a CPU worker's default
    registry = CollectorRegistry()
    config = PerfModelConfig(calibrate=False, budget_floor_tokens=8, slo=ItlTarget(itl_ms=26.2),
                             ttft=TtftTarget(ttft_ms=550.0))
    tracker = PerfTracker(engine, WorkerPerf(), config, registry)
    assert engine.scheduler.itl_budget is tracker.budget and tracker.budget.ttft_s == 0.55
    before = dict(engine.scheduler.budget_steps)  # the engine served the tests above
    # a model (not fitted: this machine's speed must not matter) whose room beside 4 rows is 24
    # prompt tokens a step, too few for four 200-token prompts within 0.55 s (tests/engine/
    # test_engine_itl_budget.py has the arithmetic); every request has waited 0 s by the clock
    tracker.budget.model = StepModel.from_dict({"base_s": 0.010, "prefill_token_s": 0.0005, "attended_pair_s": 0.0,
                                                "decode_row_s": 0.001, "context_token_s": 0.0})
    started = time.monotonic()
    engine.scheduler.clock = lambda: started
    try:
        for p in random_prompts(4, [6, 9, 5, 7], seed=60):
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        for _ in range(2):  # the rows' prompts, then their first decode step
            t0 = time.perf_counter()
            engine.step()
            tracker.on_step(t0, time.perf_counter())
        drive(engine, tracker, random_prompts(4, [200] * 4, seed=61), 2)
    finally:
        engine.scheduler.itl_budget, engine.scheduler.clock = None, time.monotonic
    value = registry.get_sample_value
    steps = {slo: n - before[slo] for slo, n in engine.scheduler.budget_steps.items()}
    assert steps["ttft"] > 0 and steps["itl"] > 0, steps
    assert {slo: value("duet_engine_prefill_budget_steps_total", {"slo": slo}) for slo in steps} == steps


def test_a_prefill_worker_fits_its_handoff_tail():
    metrics = DuetMetrics("prefill", process_metrics=False)

    class Idle:  # an engine that never steps: only the handoff side is exercised
        class scheduler:
            num_batches, last_batch, last_allowance, itl_budget = 0, None, None, None
            budget_steps = {"itl": 0, "ttft": 0}
        overlap, spec, device = None, None, type("D", (), {"type": "cpu"})()
        runner = type("R", (), {"graphs": None, "prefill_graphs": None})()

    perf = WorkerPerf()
    tracker = PerfTracker(Idle(), perf, PerfModelConfig(calibrate=False), metrics.registry,
                          handoffs=handoff_totals(metrics.registry))
    before = perf.transfer
    for _ in range(4):
        metrics.observe_kv_transfer("sent", 64 << 20, 0.05)
        metrics.kv_handoff_tail_seconds.observe(0.02)
    tracker.refit()
    assert perf.transfer.samples == 1 and perf.transfer != before
    assert perf.transfer.seconds(64 << 20) == pytest.approx(0.02, rel=0.05)


def test_steps_that_carry_prompts_alone_keep_a_model_of_their_own(engine):
    """A `both` worker's steps are mostly mixed; the model of its steps with prompts alone, which a
    split's prefill worker runs, is fitted apart and published beside (perf_prefill_step)."""
    from shared.perf_model.step_model import StepShape, attended_pairs

    def prefill_s(tokens: int) -> float:  # a prompt's steps alone: 5 ms and 20 us a token
        return 0.005 + 20e-6 * tokens

    calibration = [(StepShape(n, attended_pairs(0, n)), prefill_s(n)) for n in (64, 256, 1024)] + \
        [(StepShape(0, 0, rows, rows * 100), 0.005 + rows * 50e-6) for rows in (1, 8, 32)]
    perf = WorkerPerf()
    tracker = PerfTracker(engine, perf, PerfModelConfig(calibrate=False), CollectorRegistry(), calibration=calibration)
    alone = perf.prefill_step
    assert alone is not None and alone.samples == 3
    assert alone.step_s(StepShape(2048, attended_pairs(0, 2048))) == pytest.approx(prefill_s(2048), rel=0.05)
    # many mixed steps whose chunks cost three times as much a token (short chunks, padded graphs)
    for k in range(400):
        n = 32 + k % 64
        tracker._add(StepShape(n, attended_pairs(4000, n), 16, 16 * 4000), 0.006 + n * 60e-6)
    tracker._new = True
    tracker.refit()
    whole = StepShape(2048, attended_pairs(0, 2048))
    assert perf.step.step_s(whole) > 1.3 * prefill_s(2048)  # the worker's model now prices a prompt by those
    assert perf.prefill_step.samples == 3 and perf.prefill_step.step_s(whole) == pytest.approx(prefill_s(2048), rel=0.05)
    published = WorkerPerf.from_fields(perf.fields()).prefill_step  # through the registry entry
    assert published.coef == pytest.approx(perf.prefill_step.coef) and published.samples == 3
    assert WorkerPerf.from_fields({k: v for k, v in perf.fields().items() if k != "perf_prefill_step"}) \
        .prefill_step is None  # an entry from a worker before the field
    # a prefill worker without calibration: prompts alone, never a decode row; the whole model
    # waits for decode steps, the model of prompts alone for five of its own
    cold = WorkerPerf()
    prefill_worker = PerfTracker(engine, cold, PerfModelConfig(calibrate=False), CollectorRegistry())
    for n in (64, 128, 256, 512, 1024):
        assert cold.prefill_step is None
        prefill_worker._add(StepShape(n, attended_pairs(0, n)), prefill_s(n))
        prefill_worker._new = True
        prefill_worker.refit()
    assert cold.step is None and cold.prefill_step.samples == 5
    assert cold.prefill_step.step_s(whole) == pytest.approx(prefill_s(2048), rel=0.05)
    engine.scheduler.itl_budget = None
