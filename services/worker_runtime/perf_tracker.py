"""A worker's step-time model, kept current while it serves, and the prefill budget it drives.

Every engine step is timed (engine_loop.py `step_timers`, step_sampler.py) and folded into an
exponentially weighted least-squares fit (shared/perf_model/linear_fit.py) seeded with the
start-up calibration (services/worker/perf_calibration.py). Every REFIT_S the fit is solved
again; the new model goes to the scheduler's inter-token budget (shared/perf_model/step_budget.py)
and into the worker's registry entry (`perf_*` fields), which the router reads to place
prefills. A prefill worker also fits its KV handoff tail (shared/perf_model/transfer_model.py)
from its own transfer counters. Everything runs on the engine-loop thread."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from services.worker_runtime.step_sampler import StepSampler
from shared.perf_model.config import PerfModelConfig, default_itl_s
from shared.perf_model.linear_fit import OnlineLinearFit
from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.step_model import RIDGE, TERMS, StepModel, StepShape
from shared.perf_model.transfer_model import TransferModel
from shared.perf_model.worker_perf import WorkerPerf

log = logging.getLogger("duet.worker.perf")

REFIT_S = 2.0
HALF_LIFE_STEPS = 1000.0      # a step's weight halves after this many later steps
HALF_LIFE_HANDOFFS = 30.0     # refit intervals with handoffs
# without calibration, a model is published once live steps covered both kinds of work
MIN_PREFILL_STEPS, MIN_DECODE_STEPS = 5, 5
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)

Samples = list[tuple[StepShape, float]]
HandoffTotals = Callable[[], tuple[float, float, float]]  # (bytes sent, handoff tail seconds, handoffs)


class PerfTracker:
    def __init__(self, engine, perf: WorkerPerf, config: PerfModelConfig, registry, *,
                 calibration: Samples = (), handoffs: HandoffTotals | None = None):
        self.engine = engine
        self.perf = perf
        lagged = engine.overlap is not None and engine.device.type == "cuda"
        self.sampler = StepSampler(engine.scheduler, lagged=lagged, overlap=engine.overlap if lagged else None)
        n = len(StepShape().features())
        seed = OnlineLinearFit([0.0] * n, HALF_LIFE_STEPS, RIDGE)  # the calibration alone: the prior
        for shape, seconds in calibration:
            seed.add(shape.features(), seconds)
        prior, _ = seed.solve()
        self.fit = OnlineLinearFit(prior, HALF_LIFE_STEPS, RIDGE)
        # the steps that carry prompts alone, apart: what a prefill worker runs. A `both` worker's
        # fit is mostly mixed steps (short chunks beside decode rows, often in a padded graph),
        # which price a whole prompt's chunks wrongly, and the planner predicts a split's
        # prefill workers by this one (services/planner/predict.py)
        self.prefill_fit = OnlineLinearFit(prior, HALF_LIFE_STEPS, RIDGE)
        self.kinds = {"prefill": 0, "decode": 0, "prefill_only": 0}
        for shape, seconds in calibration:
            self._add(shape, seconds)
        self.calibrated = bool(calibration)
        target = config.slo.itl_ms / 1000 if config.slo.itl_ms > 0 else default_itl_s(engine.device.type)
        # the queue's first-token target, weighed only where the inter-token budget runs
        ttft = config.ttft.target_s(engine.device.type == "cuda") if config.budget_ttft else 0.0
        self.budget = ItlBudget(target, max(1, config.budget_floor_tokens), ttft_s=ttft,
                                graph_rows=budget_graph_rows(engine), graph_tokens=budget_graph_tokens(engine))
        if config.itl_budget:
            engine.scheduler.itl_budget = self.budget
        perf.itl_target_s = target
        perf.budget_floor_tokens = max(1, config.budget_floor_tokens) if config.itl_budget else 0
        perf.ttft_target_s = ttft if config.itl_budget else 0.0
        perf.budget_graph_rows = self.budget.graph_rows
        perf.budget_graph_tokens = self.budget.graph_tokens
        if engine.spec is not None:  # a speculating step's rows, up to the batch it speculates at
            perf.budget_row_tokens, perf.budget_spec_rows = engine.spec.k + 1, engine.spec.policy.max_batch
        self.handoffs = handoffs
        self._handoff_seen = (0.0, 0.0, 0.0)
        self.transfer_fit = OnlineLinearFit(TransferModel().coef(), HALF_LIFE_HANDOFFS) if handoffs else None
        if handoffs:
            perf.transfer = TransferModel()
        self.step_seconds = Histogram("duet_engine_step_seconds", "Engine step time, by what the step carried "
                                      "(prefill chunks, decode rows, or both)", ["phase"], buckets=_STEP_BUCKETS,
                                      registry=registry)
        self.budget_tokens = Gauge("duet_engine_prefill_budget_tokens", "Prefill tokens the last step beside "
                                   "decode rows could take under the inter-token target", registry=registry)
        self.budget_steps = Counter("duet_engine_prefill_budget_steps", "Steps beside decode rows, by the "
                                    "target that set their prefill room: itl (the inter-token target), ttft "
                                    "(widened for the queue's time to first token)", ["slo"], registry=registry)
        self._budget_steps_seen = dict(engine.scheduler.budget_steps)
        for slo in self._budget_steps_seen:
            self.budget_steps.labels(slo=slo)  # both series from the start, at 0
        self.model_error = Gauge("duet_engine_step_model_error_ratio", "Relative RMS error of the step-time model "
                                 "over the steps it was fitted to", registry=registry)
        # the model itself, as the registry entry carries it: what the budget and the router
        # predicted with at any moment (a model fitted in one role meets another's steps after a switch)
        self.model_terms = Gauge("duet_engine_step_model_coefficient", "The step-time model's coefficients in "
                                 "natural units (seconds per step, per prompt token, per attended pair, per "
                                 "decode row, per context token)", ["term"], registry=registry)
        self._last_refit = float("-inf")
        self._new = bool(calibration)
        self.refit()

    def _add(self, shape: StepShape, seconds: float) -> None:
        self.fit.add(shape.features(), seconds)
        self.kinds["prefill"] += shape.prefill_tokens > 0
        self.kinds["decode"] += shape.decode_rows > 0
        if shape.prefill_tokens > 0 and shape.decode_rows == 0:
            self.prefill_fit.add(shape.features(), seconds)
            self.kinds["prefill_only"] += 1

    # -- engine-loop hooks --------------------------------------------------------------
    def on_step(self, t0: float, t1: float) -> None:
        sampled = self.sampler.sample(t0, t1)
        if sampled is not None:
            shape, seconds = sampled
            self._add(shape, seconds)
            self._new = True
            if shape.steps == 1:  # a window of several batches is no one step's time
                self.step_seconds.labels(phase=shape.phase).observe(seconds)
        room = self.engine.scheduler.last_allowance
        if room is not None and room.first is not None:
            self.budget_tokens.set(room.first)
        for slo, n in self.engine.scheduler.budget_steps.items():
            if n > self._budget_steps_seen[slo]:
                self.budget_steps.labels(slo=slo).inc(n - self._budget_steps_seen[slo])
                self._budget_steps_seen[slo] = n

    def __call__(self) -> None:
        """after_iteration: refit at most every REFIT_S."""
        if time.monotonic() - self._last_refit >= REFIT_S:
            self.refit()

    def refit(self) -> None:
        self._last_refit = time.monotonic()
        if self.transfer_fit is not None:
            self._refit_transfer()
        if not self._new:
            return
        self._new = False
        # a prefill worker never runs the decode steps the whole model waits for: its own gate
        if self.kinds["prefill_only"] >= (1 if self.calibrated else MIN_PREFILL_STEPS):
            alone, alone_rel = self.prefill_fit.solve()
            self.perf.prefill_step = StepModel(alone, self.prefill_fit.count, alone_rel)
        usable = self.calibrated or (self.kinds["prefill"] >= MIN_PREFILL_STEPS
                                     and self.kinds["decode"] >= MIN_DECODE_STEPS)
        if not usable:
            return
        coef, rel = self.fit.solve()
        model = StepModel(coef, self.fit.count, rel)
        self.budget.model = self.perf.step = model
        self.model_error.set(rel)
        for term, value in model.to_dict().items():
            if term in TERMS:
                self.model_terms.labels(term=term).set(value)

    def _refit_transfer(self) -> None:
        now = self.handoffs()
        sent, tail, count = (a - b for a, b in zip(now, self._handoff_seen))
        self._handoff_seen = now
        if count <= 0 or tail <= 0:
            return
        self.transfer_fit.add((1.0, sent / count / 1e9), tail / count)
        coef, _ = self.transfer_fit.solve()
        self.perf.transfer = TransferModel.from_coef(coef, self.transfer_fit.count)


def budget_graph_rows(engine) -> int:
    """Decode rows beside which a step with a prefill chunk still replays a CUDA graph (the
    prefill graphs' sequences, the decode graphs' batch and a few prompts, less the chunk's
    own): past them the budget does not slice
    (step_budget.py). -1 without graphs: every step is eager alike."""
    runner = engine.runner
    if runner.graphs is None:
        return -1
    return runner.prefill_graphs.max_seqs - 1 if runner.prefill_graphs is not None else 0


def budget_graph_tokens(engine) -> int:
    """Tokens a step with a prefill chunk holds and still replays a CUDA graph (its decode rows
    and the chunk): the budget's slices stay within them. 0 without prefill graphs."""
    graphs = engine.runner.prefill_graphs
    return graphs.max_tokens if engine.runner.graphs is not None and graphs is not None else 0


def handoff_totals(registry) -> HandoffTotals:
    """A prefill worker's handoffs so far, from its own metrics (shared/telemetry/metrics.py)."""
    def read() -> tuple[float, float, float]:
        value = registry.get_sample_value
        return (value("duet_kv_transfer_bytes_total", {"direction": "sent"}) or 0.0,
                value("duet_kv_handoff_tail_seconds_sum") or 0.0,
                value("duet_kv_handoff_tail_seconds_count") or 0.0)
    return read
