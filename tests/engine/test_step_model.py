"""The worker's step-time model (shared/perf_model): fitted from timed steps, non-negative
and monotone, refitted as the hardware's behaviour changes, through the registry intact."""
from __future__ import annotations

import random

import pytest

from shared.perf_model.linear_fit import OnlineLinearFit
from shared.perf_model.prefill_time import PrefillSite
from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.ttft_pressure import QueuedPrefill, needed_rate
from shared.perf_model.step_model import StepModel, StepShape, attended_pairs
from shared.perf_model.transfer_model import TransferModel
from shared.perf_model.worker_perf import WorkerPerf
from shared.registry.worker_info import WorkerInfo, WorkerLoad

# a GPU-like truth: 8 ms a step, 40 us a prefill token, attention, 60 us a decode row, KV reads
TRUTH = StepModel.from_dict({"base_s": 0.008, "prefill_token_s": 4e-5, "attended_pair_s": 2e-10,
                             "decode_row_s": 6e-5, "context_token_s": 3e-8})


def shapes(rng: random.Random, n: int) -> list[StepShape]:
    out = []
    for _ in range(n):
        rows = rng.choice([0, 1, 8, 32, 128])
        ctx = rows * rng.choice([100, 1000, 4000])
        chunk, start = rng.choice([(0, 0), (64, 0), (512, 2000), (2048, 0), (8000, 500)])
        if rows == 0 and chunk == 0:
            chunk = 256
        out.append(StepShape(chunk, attended_pairs(start, chunk), rows, ctx))
    return out


def fit(samples, prior=(0.0,) * 5) -> StepModel:
    f = OnlineLinearFit(prior, half_life=1e9)
    for shape, seconds in samples:
        f.add(shape.features(), seconds)
    coef, rel = f.solve()
    return StepModel(coef, f.count, rel)


def test_fits_synthetic_steps_with_noise():
    rng = random.Random(0)
    samples = [(s, TRUTH.step_s(s) * rng.uniform(0.95, 1.05)) for s in shapes(rng, 400)]
    model = fit(samples)
    got, want = model.to_dict(), TRUTH.to_dict()
    for term in ("base_s", "prefill_token_s", "decode_row_s"):
        assert got[term] == pytest.approx(want[term], rel=0.1), term
    for shape in shapes(rng, 50):
        assert model.step_s(shape) == pytest.approx(TRUTH.step_s(shape), rel=0.06)
    assert 0 < model.rel_error < 0.05 and model.samples == 400


def test_coefficients_stay_non_negative_and_predictions_grow_with_the_batch():
    # decode steps whose time does not depend on context, with noise that an unconstrained
    # fit turns into a negative context coefficient
    rng = random.Random(1)
    samples = [(StepShape(decode_rows=r, decode_context=r * c), 0.01 + 1e-4 * r - 1e-9 * r * c * rng.random())
               for r in (1, 4, 16, 64) for c in (10, 5000) for _ in range(5)]
    model = fit(samples)
    assert all(c >= 0 for c in model.coef)
    steps = [model.step_s(StepShape(decode_rows=r, decode_context=r * 2000)) for r in range(0, 257, 16)]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    more_prefill = [TRUTH.step_s(StepShape(n, attended_pairs(1000, n), 32, 32000)) for n in (0, 64, 512, 4096)]
    assert more_prefill == sorted(more_prefill)


def test_a_refit_follows_the_hardware_and_keeps_the_prior_where_data_is_silent():
    prior = TRUTH.coef
    f = OnlineLinearFit(prior, half_life=200)
    slow = StepModel(tuple(c * 2 for c in TRUTH.coef))
    rng = random.Random(2)
    # only decode steps, twice as slow as calibrated (a clock drop, another tenant)
    for _ in range(2000):
        s = StepShape(decode_rows=rng.choice([1, 16, 64]), decode_context=rng.choice([1000, 50000]))
        f.add(s.features(), slow.step_s(s))
    model = StepModel(*f.solve())
    decode = StepShape(decode_rows=32, decode_context=64000)
    assert model.step_s(decode) == pytest.approx(slow.step_s(decode), rel=0.05)
    # prefill was never seen live: its coefficient stays the prior's
    assert model.to_dict()["prefill_token_s"] == pytest.approx(TRUTH.to_dict()["prefill_token_s"], rel=0.05)


def test_largest_chunk_inverts_the_chunk_cost():
    for start in (0, 1000, 30000):
        for seconds in (0.001, 0.01, 0.1):
            n = TRUTH.largest_chunk(seconds, start)
            assert TRUTH.chunk_s(start, n) <= seconds < TRUTH.chunk_s(start, n + 1)
    assert TRUTH.largest_chunk(0.0, 0) == 0


def test_budget_keeps_the_step_under_the_target_with_a_floor():
    budget = ItlBudget(target_s=0.030, floor_tokens=16, model=TRUTH)
    assert budget.begin(0, 0) is None  # no decode rows: nothing to protect
    room = budget.begin(64, 64 * 2000)
    first = room.allow(3000)
    room.charge(3000, first)
    step = TRUTH.step_s(StepShape(first, attended_pairs(3000, first), 64, 64 * 2000))
    assert step <= 0.030 < TRUTH.step_s(StepShape(first + 1, attended_pairs(3000, first + 1), 64, 64 * 2000))
    assert room.allow(0) == 0  # the step is full: a second chunk gets nothing
    # a batch whose decode step alone passes the target still moves prefill by the floor
    assert budget.begin(2000, 2000 * 8000).allow(0) == 16


def test_the_queue_asks_for_the_rate_its_tightest_first_token_needs():
    # served in order: 200 tokens in 1 s, 600 in 1.5 s, 700 in 2 s: the second is the tightest
    queue = [QueuedPrefill(200, 1.0), QueuedPrefill(400, 0.5), QueuedPrefill(100, 0.0)]
    assert needed_rate(queue, 2.0) == pytest.approx(400.0)
    # past its target a request is still given a quarter of it; one whose first token came sets
    # no deadline, though its tokens go ahead of the rest
    assert needed_rate([QueuedPrefill(100, 9.0)], 2.0) == pytest.approx(200.0)
    assert needed_rate([QueuedPrefill(500, 9.0, first_token_due=False), QueuedPrefill(100, 0.0)], 2.0) == \
        pytest.approx(300.0)
    assert needed_rate([], 2.0) == 0.0


def test_a_queue_past_the_itl_room_gets_the_tokens_its_rate_needs_up_to_the_token_budget():
    budget = ItlBudget(target_s=0.030, floor_tokens=16, model=TRUTH, ttft_s=1.0)
    itl = budget.begin(64, 64 * 2000)
    assert (itl.slo, itl.need_tokens) == ("itl", 0)  # no queue: the target's room
    short = budget.begin(64, 64 * 2000, [QueuedPrefill(10, 0.0)], 8000)
    assert (short.slo, short.allow(0)) == ("itl", itl.allow(0))
    wide = budget.begin(64, 64 * 2000, [QueuedPrefill(20000, 0.0)], 8000)
    base = TRUTH.step_s(StepShape(decode_rows=64, decode_context=64 * 2000))
    n = wide.allow(0)
    assert wide.slo == "ttft" and n == wide.need_tokens > itl.allow(0)
    # the fewest tokens a step that compute 20000 a second
    assert n >= 20000 * (base + TRUTH.chunk_s(0, n)) and n - 1 < 20000 * (base + TRUTH.chunk_s(0, n - 1))
    wide.charge(0, 100)
    assert wide.allow(100) == n - 100  # later chunks share what the queue asked of the step
    # more than the token budget can give: the token budget
    assert budget.begin(64, 64 * 2000, [QueuedPrefill(10**7, 0.0)], 8000).need_tokens == 8000


def test_beside_more_rows_than_a_graph_holds_the_budget_does_not_slice():
    """A step with a chunk beside more decode rows than the prefill graphs hold runs eagerly,
    whatever the chunk's size: the budget then leaves the chunk to the token budget (one wide
    eager step), and slices only where the mixed step still replays a graph."""
    budget = ItlBudget(0.030, 16, TRUTH, graph_rows=7)
    assert budget.begin(7, 7 * 3000) is not None      # 7 rows + the chunk: a graph's 8 sequences
    assert budget.begin(8, 8 * 3000) is None          # eager anyway: not sliced
    assert budget.begin(2000, 2000 * 8000) is None    # the floor no longer makes every step eager
    assert ItlBudget(0.030, 16, TRUTH).begin(2000, 2000 * 8000).allow(0) == 16  # no graphs (-1): sliced
    # the router's simulation of such a worker: the prompt goes in one step, not the floor's many
    busy = PrefillSite(TRUTH, 128, 128 * 3000, 8192, ItlBudget(0.030, 16, TRUTH, graph_rows=7))
    assert busy.chunk(3000, 0) == 3000
    assert busy.prefill_s(3000) == pytest.approx(busy.step_s(3000))


def test_prefill_time_is_many_small_steps_beside_a_busy_batch():
    idle = PrefillSite(TRUTH, max_batched_tokens=8192, budget=ItlBudget(0.030, 16, TRUTH))
    busy = PrefillSite(TRUTH, 128, 128 * 3000, 8192, ItlBudget(0.030, 16, TRUTH))
    assert idle.prefill_s(300, 9000) == pytest.approx(idle.step_s(300, 9000))
    assert busy.chunk(300, 9000) < 300
    assert busy.prefill_s(300, 9000) > 2 * busy.step_s()


def test_the_simulated_prefill_widens_as_the_workers_budget_does_for_its_first_token_target():
    """A long prompt beside a busy batch: the ITL room alone takes ~70 steps; a worker that weighs
    its 2 s first-token target takes chunks wide enough to finish near it, and the simulation says
    so chunk by chunk (each step's chunk is what the worker's own budget grants a request that has
    waited the simulated time so far)."""
    itl_only = PrefillSite(TRUTH, 128, 128 * 3000, 8192, ItlBudget(0.030, 16, TRUTH))
    weighed = PrefillSite(TRUTH, 128, 128 * 3000, 8192, ItlBudget(0.030, 16, TRUTH, ttft_s=2.0))
    tokens = 12000
    slow, fast = itl_only.prefill_s(tokens), weighed.prefill_s(tokens)
    assert slow > 5.0 and fast < 0.5 * slow
    # near its target (the widening prices a chunk's attention as a prompt's first, so a long
    # prompt's later chunks run a little past what it asked for)
    assert fast < 1.3 * 2.0
    # step by step the chunk is the worker's own allowance for that wait
    done, waited = 0, 0.0
    budget = ItlBudget(0.030, 16, TRUTH, ttft_s=2.0)
    while done < tokens:
        n = weighed.chunk(tokens - done, done, waited)
        room = budget.begin(128, 128 * 3000, [QueuedPrefill(tokens - done, waited)], 8192 - 128)
        assert n == min(tokens - done, room.allow(done))
        waited += weighed.step_s(n, done)
        done += n
    assert waited == pytest.approx(fast, rel=0.02)  # past 64 steps the simulation goes on at the last rate
    # a short prompt within the ITL room: both simulations agree
    assert weighed.prefill_s(40, 9000) == itl_only.prefill_s(40, 9000)


def test_beside_fewer_rows_the_budget_slices_within_the_tokens_a_graph_holds():
    """A mixed step replays a graph only up to the graphs' tokens (decode rows and chunk): the
    ITL room's slice stays within them, the first-token target's widening may pass them (one
    wide eager step, as asked), and the floor still goes."""
    free = ItlBudget(0.200, 16, TRUTH, graph_rows=263)
    capped = ItlBudget(0.200, 16, TRUTH, graph_rows=263, graph_tokens=512)
    wide = free.begin(100, 100 * 1000).allow(0)
    assert wide > 412  # a 200 ms target leaves room for far more than the graph holds
    room = capped.begin(100, 100 * 1000)
    assert room.allow(0) == 412  # 512 less the 100 decode rows
    room.charge(0, 300)
    assert room.allow(300) == 112  # the step's later chunks share what is left
    full = ItlBudget(0.200, 16, TRUTH, graph_rows=263, graph_tokens=256)
    assert full.begin(260, 260 * 1000) is None  # no room for the floor in the graph: eager anyway, not sliced
    assert full.begin(100, 100 * 1000, row_tokens=3) is None  # speculating rows fill it alike
    assert full.begin(80, 80 * 1000, row_tokens=3).allow(0) == 16  # 16 tokens of room: the floor
    # the queue's first-token target asks more than the graph holds: widened past it
    pressed = ItlBudget(0.200, 16, TRUTH, ttft_s=0.5, graph_rows=263, graph_tokens=512)
    asked = pressed.begin(100, 100 * 1000, [QueuedPrefill(40000, 0.0)], 8192)
    assert asked.slo == "ttft" and asked.allow(0) > 412
    # the router's simulation of such a worker cuts the same slices
    site = PrefillSite(TRUTH, 100, 100 * 1000, 8192, capped)
    assert site.chunk(3000, 0) == 412
    # and of a speculating worker (K = 2, published as row_tokens 3, up to 128 rows): its rows take
    # 300 of the 512, as its scheduler counts them; above its speculation's batch they are plain rows
    assert PrefillSite(TRUTH, 100, 100 * 1000, 8192, capped, row_tokens=3, spec_rows=128).chunk(3000, 0) == 212
    assert capped.begin(100, 100 * 1000, row_tokens=3).allow(0) == 212  # what its scheduler cuts
    assert PrefillSite(TRUTH, 100, 100 * 1000, 8192, capped, row_tokens=3, spec_rows=32).chunk(3000, 0) == 412


def test_registry_entry_carries_the_models():
    perf = WorkerPerf(TRUTH, TransferModel(0.003, 5e9, 7), 0.03, 32, 2.0, 7, 512, 5, 32)
    info = WorkerInfo(worker_id="d1", role="decode", address="x:1", model="m", perf=perf,
                      load=WorkerLoad(running_requests=3, decode_context_tokens=9000))
    back = WorkerInfo.from_hash({k.encode(): v.encode() for k, v in info.to_hash().items()})
    assert back.load.decode_context_tokens == 9000
    assert back.perf.step.step_s(StepShape(100, 5e3, 3, 9000)) == pytest.approx(TRUTH.step_s(StepShape(100, 5e3, 3, 9000)))
    assert back.perf.transfer == TransferModel(0.003, 5e9, 7)
    assert (back.perf.itl_target_s, back.perf.budget_floor_tokens, back.perf.ttft_target_s,
            back.perf.budget_graph_rows, back.perf.budget_graph_tokens, back.perf.budget_row_tokens,
            back.perf.budget_spec_rows) == (0.03, 32, 2.0, 7, 512, 5, 32)
    bare = WorkerInfo.from_hash(WorkerInfo(worker_id="p1", role="prefill", address="x:1", model="m").to_hash())
    assert bare.perf.step is None and bare.perf.transfer is None and bare.perf.budget_graph_rows == -1
    assert (bare.perf.budget_graph_tokens, bare.perf.budget_row_tokens, bare.perf.budget_spec_rows) == (0, 1, 0)
