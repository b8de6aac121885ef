"""Prefill beside decode rows within an inter-token budget (shared/perf_model/step_budget.py,
the scheduler's `itl_budget`): while decode rows run, a long prompt goes in chunks no larger
than what keeps the step under the target by the step model; alone, it takes the token
budget; the answers are the same either way."""
from __future__ import annotations

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
    return eng


def serve(eng: Engine, rows: list[list[int]], long_prompt: list[int]):
    """Start the rows, once they decode add the long prompt; every step's batch and the
    long prompt's tokens."""
    for p in rows:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    batches, long_rid, tokens = [], None, []
    while eng.has_work:
        outs = eng.step()
        seen = eng.scheduler.num_batches
        if seen and (not batches or batches[-1][0] != seen):
            batches.append((seen, StepShape.of_batch(eng.scheduler.last_batch.items)))
        if long_rid is None and len(batches) >= 3:
            long_rid = eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=5))
        tokens += [t for o in outs if o.rid == long_rid for t in o.token_ids]
    assert_all_pages_free(eng)
    return [shape for _, shape in batches], tokens


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
