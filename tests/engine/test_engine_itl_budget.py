"""Prefill beside decode rows within an inter-token budget (shared/perf_model/step_budget.py,
the scheduler's `itl_budget`): while decode rows run, a long prompt goes in chunks no larger
than what keeps the step under the target by the step model; alone, it takes the token
budget; the answers are the same either way. A queue of prompts that the target's room cannot
clear within the time-to-first-token target widens the chunks by what the model says the queue
needs; a short one leaves the room as it was. The scheduler's clock is held at the engine's
start, so every request has waited 0 s whatever the machine's speed: the chunks are exact."""
from __future__ import annotations

import itertools
import time

import pytest

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.step_model import StepModel, StepShape
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, kv_bytes_for_pages, random_prompts

pytestmark = pytest.mark.usefixtures("torch_one_thread")
KIND = "llama_tied_gqa2"
# 10 ms a step, 0.5 ms a prefill token, 1 ms a decode row: beside 4 rows a 26.2 ms target
# leaves room for 24 prompt tokens (10 + 4 + 24 * 0.5 = 26 ms)
MODEL = StepModel.from_dict({"base_s": 0.010, "prefill_token_s": 0.0005, "attended_pair_s": 0.0,
                             "decode_row_s": 0.001, "context_token_s": 0.0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("itl") / KIND, KIND, seed=41)


def engine(model_dir, budget: ItlBudget | None) -> Engine:
    eng = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", page_size=4,
                 max_num_batched_tokens=256, kv_cache_memory=kv_bytes_for_pages(model_dir, 512, 4))
    eng.scheduler.itl_budget = budget
    started = time.monotonic()
    eng.scheduler.clock = lambda: started  # every request arrives after: each has waited 0 s
    return eng


def serve(eng: Engine, rows: list[list[int]], *long_prompts: list[int]):
    """Start the rows, once they decode add the long prompts; every step's batch and the
    long prompts' tokens (of the first alone when there is one)."""
    for p in rows:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    batches, long_rids, tokens = [], [], {}
    while eng.has_work:
        outs = eng.step()
        seen = eng.scheduler.num_batches
        if seen and (not batches or batches[-1][0] != seen):
            batches.append((seen, StepShape.of_batch(eng.scheduler.last_batch.items)))
        if not long_rids and len(batches) >= 3:
            long_rids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=5)) for p in long_prompts]
        for o in outs:
            if o.rid in long_rids:
                tokens.setdefault(o.rid, []).extend(o.token_ids)
    assert_all_pages_free(eng)
    answers = [tokens.get(rid, []) for rid in long_rids]
    return [shape for _, shape in batches], answers[0] if len(answers) == 1 else answers


def test_long_prefill_goes_in_budget_sized_chunks_beside_decode_rows(model_dir):
    rows = random_prompts(4, [6, 9, 5, 7], seed=42)
    long_prompt = random_prompts(1, [200], seed=43)[0]
    budget = ItlBudget(target_s=0.0262, floor_tokens=8, model=MODEL)
    shapes, tokens = serve(engine(model_dir, budget), rows, long_prompt)
    mixed = [s for s in shapes if s.decode_rows == 4 and s.prefill_tokens]
    assert len(mixed) >= 200 // 24, shapes
    assert all(s.prefill_tokens <= 24 for s in mixed), [s.prefill_tokens for s in mixed]
    assert max(s.prefill_tokens for s in mixed) == 24
    assert all(MODEL.step_s(s) <= 0.0262 for s in mixed)
    # without the budget the prompt rides in one step beside the rows; same answer
    plain_shapes, plain_tokens = serve(engine(model_dir, None), rows, long_prompt)
    assert any(s.decode_rows == 4 and s.prefill_tokens == 200 for s in plain_shapes), plain_shapes
    assert tokens == plain_tokens and len(tokens) == 5


def test_a_batch_over_the_target_still_moves_prefill_by_the_floor(model_dir):
    rows = random_prompts(4, [6, 9, 5, 7], seed=44)
    budget = ItlBudget(target_s=0.005, floor_tokens=8, model=MODEL)  # 4 rows alone take 14 ms
    shapes, tokens = serve(engine(model_dir, budget), rows, random_prompts(1, [40], seed=45)[0])
    mixed = [s.prefill_tokens for s in shapes if s.decode_rows == 4 and s.prefill_tokens]
    assert mixed and set(mixed) == {8}, mixed
    assert len(tokens) == 5


def test_a_queue_the_itl_room_cannot_clear_in_time_widens_the_chunks_by_what_it_needs(model_dir):
    """Beside 4 rows the 26.2 ms target leaves 24 prompt tokens a step (22 beside 5): 24 tokens
    / 26 ms, about 923 a second, 507 within a 0.55 s first-token target (465 beside 5 rows).
    Four 200-token prompts (800) need 1455 a second: c tokens a step give that where
    c >= 1455 * (14 ms + 0.5 ms * c), so c = 75. As the queue drains it needs less, until what
    is left fits the target's room again."""
    rows = random_prompts(4, [6, 9, 5, 7], seed=46)
    prompts = random_prompts(4, [200] * 4, seed=47)
    eng = engine(model_dir, ItlBudget(target_s=0.0262, floor_tokens=8, model=MODEL, ttft_s=0.55))
    shapes, answers = serve(eng, rows, *prompts)
    room = {4: 24, 5: 22}  # a prompt done goes on as a fifth row
    mixed = [(s.decode_rows, s.prefill_tokens) for s in shapes if s.decode_rows in room and s.prefill_tokens]
    assert mixed[0] == (4, 75), mixed  # today's budget: 24
    widened = list(itertools.takewhile(lambda m: m[1] > room[m[0]], mixed))
    assert len(widened) >= 3 and all(n <= room[r] for r, n in mixed[len(widened):]), mixed
    tokens = [n for _, n in widened]
    assert tokens == sorted(tokens, reverse=True), mixed
    # widened just until the room clears what is left within the target
    assert 800 - sum(tokens) <= 0.55 / 0.026 * 24 and 800 - sum(tokens[:-1]) > 0.55 / 0.026 * 22, mixed
    assert eng.scheduler.budget_steps["ttft"] == len(widened) and eng.scheduler.budget_steps["itl"] > 0
    # the widening changes when the prompts are computed, never what they answer
    _, plain = serve(engine(model_dir, None), rows, *prompts)
    assert answers == plain and all(len(a) == 5 for a in answers)


def test_a_short_queue_leaves_the_itl_room_as_it_was(model_dir):
    """One 200-token prompt needs 400 tokens a second for a 0.5 s target: the 24-token room
    gives 923, so the first-token target asks nothing more and the chunks stay at 24."""
    rows = random_prompts(4, [6, 9, 5, 7], seed=42)
    long_prompt = random_prompts(1, [200], seed=43)[0]
    weighed = engine(model_dir, ItlBudget(target_s=0.0262, floor_tokens=8, model=MODEL, ttft_s=0.5))
    shapes, tokens = serve(weighed, rows, long_prompt)
    plain_shapes, plain_tokens = serve(engine(model_dir, ItlBudget(target_s=0.0262, floor_tokens=8, model=MODEL)),
                                       rows, long_prompt)
    mixed = [s.prefill_tokens for s in shapes if s.decode_rows == 4 and s.prefill_tokens]
    assert mixed and max(mixed) == 24 and weighed.scheduler.budget_steps["ttft"] == 0, mixed
    assert shapes == plain_shapes and tokens == plain_tokens


def test_beside_speculating_rows_a_slice_leaves_the_drafts_room_in_the_graph(model_dir):
    """A verify step's decode rows carry K + 1 tokens each, drafts attached after the prompt's
    slice was cut: the slice stays within the graph's tokens less K + 1 a row (64 - 4 x 4 = 48
    here), so the whole step still fits the graph it would replay on a GPU; the answer is the same."""
    rows = random_prompts(4, [6, 9, 5, 7], seed=42)
    long_prompt = random_prompts(1, [200], seed=43)[0]

    def run(spec: dict):
        """(engine, (prompt-slice tokens, step tokens) of each step beside the 4 rows, the long prompt's tokens)."""
        eng = Engine(model_dir=str(model_dir), dtype="float64", device="cpu", page_size=4,
                     max_num_batched_tokens=256, kv_cache_memory=kv_bytes_for_pages(model_dir, 512, 4), **spec)
        eng.scheduler.itl_budget = ItlBudget(target_s=1.0, floor_tokens=8, model=MODEL, graph_rows=64,
                                             graph_tokens=64)
        started = time.monotonic()
        eng.scheduler.clock = lambda: started
        for p in rows:
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        steps, rid, tokens, seen = [], None, [], 0
        while eng.has_work:
            outs = eng.step()
            if eng.scheduler.num_batches != seen:
                seen, items = eng.scheduler.num_batches, eng.scheduler.last_batch.items
                chunk = sum(it.length for it in items if it.req.rid == rid)
                if chunk and len(items) == 5:
                    steps.append((chunk, sum(it.length for it in items)))
            if rid is None and seen >= 3:
                rid = eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=5))
            tokens += [t for o in outs if o.rid == rid for t in o.token_ids]
        assert_all_pages_free(eng)
        return eng, steps, tokens

    eng, steps, tokens = run(dict(speculative_method="draft", speculative_draft_model=str(model_dir),
                                  speculative_tokens=3, speculative_min_acceptance=0.0))
    assert eng.spec.stats.verify_steps > 0
    assert max(chunk for chunk, _ in steps) == 64 - 4 * 4 and all(total <= 64 for _, total in steps), steps
    _, plain_steps, plain_tokens = run({})
    assert max(chunk for chunk, _ in plain_steps) == 64 - 4, plain_steps  # a row is one token there
    assert tokens == plain_tokens and len(tokens) == 5
