"""The scheduler's waiting order: round robin across request groups (a client request's
prompts are one group; shared/engine/scheduler.py). A one-prompt request that arrives while
two prompt lists wait is admitted at the next step, not after the lists; the lists take
turns; every answer is still the one the request would get alone, and the pages come back."""
from __future__ import annotations

import pytest

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts, run_engine

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("fair") / "m", "llama_tied_gqa2", seed=41)
    # 16 tokens a step: two 8-token prompts are admitted per step
    return Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=16,
                  kv_cache_memory=4 << 20, enable_prefix_cache=False)


def test_a_one_prompt_request_is_admitted_at_the_next_step_beside_two_prompt_lists(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    lists = {g: random_prompts(12, [8], seed=42 + k) for k, g in enumerate(("list-a", "list-b"))}
    victim_prompt = random_prompts(1, [8], seed=50)[0]
    alone = run_engine(engine, [victim_prompt], params)[0].token_ids
    admitted: list[str] = []

    def step():
        before = {r.rid for r in engine.scheduler.running}
        outs = engine.step()
        admitted.extend(r.rid for r in engine.scheduler.running if r.rid not in before)
        return outs

    for g, prompts in lists.items():
        for i, p in enumerate(prompts):
            engine.add_request(p, params, rid=f"{g}-{i}", request_group=g)
    step()
    engine.add_request(victim_prompt, params, rid="victim")  # its own group
    step()
    assert "victim" in admitted[:4], admitted  # within the next step, ahead of 20 waiting list prompts
    assert len(engine.scheduler.waiting) >= 18
    got = {}
    while engine.has_work:
        for out in step():
            got.setdefault(out.rid, []).extend(out.token_ids)
    assert got["victim"] == alone
    lists_order = [rid.rsplit("-", 1)[0] for rid in admitted if rid != "victim"]
    assert all(a != b for a, b in zip(lists_order, lists_order[1:])), lists_order  # the lists take turns
    assert {r.rsplit("-", 1)[0] for r in got} == {"list-a", "list-b", "victim"}
    assert_all_pages_free(engine)


def test_the_turn_order_kept_through_a_step_is_the_one_sorted_afresh(engine):
    """schedule() sorts the turn order once a step and updates it after each admission
    (Scheduler._after_turn): after every admission, whoever was picked (the head or one passed
    over), with retracted requests at the front, it equals a fresh _turn_order()."""
    import random

    s, params = engine.scheduler, SamplingParams(temperature=0.0, max_tokens=1)
    groups = ["a", "a", "b", "c", "c", "c", "", "", "d", "b", "a", ""]
    rids = [engine.add_request(p, params, rid=f"order-{i}", request_group=g)
            for i, (g, p) in enumerate(zip(groups, random_prompts(len(groups), [8], seed=7)))]
    for rid in ("order-4", "order-9"):  # put back at the front, as a retraction does
        req = next(r for r in s.waiting if r.rid == rid)
        s._take_waiting(req)
        s.add(req, front=True)
    pick = random.Random(3)
    order = s._turn_order()
    while order:
        req = order[pick.randrange(min(3, len(order)))]
        s._take_waiting(req)
        s._turn(req.request_group or req.out_rid)
        order = s._after_turn(order, req)
        assert [r.rid for r in order] == [r.rid for r in s._turn_order()]
        engine.requests.pop(req.rid, None)
    assert not s.waiting
    for rid in rids:
        engine.requests.pop(rid, None)
