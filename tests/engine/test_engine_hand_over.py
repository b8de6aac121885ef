"""A worker hands decoding streams over (SetRole `hand_over`, services/worker/role_switch.py):
the engine ends the youngest single-sequence streams with finish reason "moved", their handlers
get that last output through the engine loop, their pages go back (to the prefix cache), and
every other stream, an n = 2 request's among them, decodes on to its end untouched."""
from __future__ import annotations

import asyncio

import pytest

from services.worker_runtime.engine_loop import EngineLoop
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts

KIND = "llama_tied_gqa2"

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("hand_over") / KIND, KIND, seed=5)


def test_the_youngest_single_streams_are_handed_over_and_the_rest_run_to_their_end(model_dir):
    engine = Engine(model_dir=str(model_dir), dtype="float32", device="cpu", page_size=4)
    loop = EngineLoop(engine)
    loop.start()
    prompts = random_prompts(4, [24, 30, 18, 21], seed=9)
    greedy = lambda n=1, most=24: SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True, n=n)  # noqa: E731

    async def run() -> dict[str, list]:
        aloop = asyncio.get_running_loop()
        queues = {rid: asyncio.Queue() for rid in ("old", "pair", "young1", "young2")}
        outs: dict[str, list] = {rid: [] for rid in queues}

        async def start(rid, prompt, params):
            await loop.acall(lambda: (engine.add_request(prompt, params, rid=rid), loop.attach(rid, aloop, queues[rid])))

        async def read(rid, tokens):  # until `tokens` output tokens arrived
            while sum(len(o.token_ids) for o in outs[rid]) < tokens:
                outs[rid].append(await queues[rid].get())

        await start("old", prompts[0], greedy())
        await start("pair", prompts[1], greedy(2))  # n = 2: never handed over
        await read("old", 8)
        await start("young1", prompts[2], greedy(most=400))  # long enough to be running when handed over
        await start("young2", prompts[3], greedy(most=400))
        await read("young1", 2)
        await read("young2", 2)
        handed = await loop.acall(lambda: loop.hand_over(2))
        assert handed == 2
        for rid in queues:  # every stream to its end
            while not (outs[rid] and outs[rid][-1].request_finished):
                outs[rid].append(await queues[rid].get())
        return outs

    try:
        outs = asyncio.run(run())
        for rid in ("young1", "young2"):
            last = outs[rid][-1]
            assert (last.finish_reason, last.finished, last.request_finished) == ("moved", True, True)
            assert sum(len(o.token_ids) for o in outs[rid]) < 400  # ended before its length
        assert outs["old"][-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs["old"]) == 24
        pair = [o for o in outs["pair"] if o.finished]
        assert sorted(o.index for o in pair) == [0, 1] and {o.finish_reason for o in pair} == {"length"}
        loop.call(lambda: None).result(10)  # the loop has run its last step
        assert loop.call(lambda: engine.hand_over(5)).result(10) == []  # nothing left to hand over
        loop.call(lambda: assert_all_pages_free(engine)).result(10)
    finally:
        loop.stop()
