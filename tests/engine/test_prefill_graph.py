"""Small prefill steps through PrefillGraphs (shared/engine/prefill_graph.py): the padded step
(unused sequences with no tokens, the padding sequence taking the bucket's remaining tokens
over the padding page, slot -1) gives the greedy tokens of the same steps run unpadded.

Both runs use the Triton attention kernels (on CPU under Triton's interpreter, in a child
process: tests/helpers/kernel_runner.py); the padded shapes run eagerly (capture=False), which
is what a captured graph replays, and on a GPU the graphs themselves are captured and replayed.
Prompts cover several token buckets, a second turn whose prefix is cached, and a batch of more
sequences than a graph holds (eager)."""
from __future__ import annotations

import torch

from tests.helpers.tiny_models import make_tiny_model

CASE = "tests.engine.test_prefill_graph:greedy_with_and_without"


def greedy_with_and_without(model_dir: str) -> dict:
    """{graphs: [tokens per request]} for the engine with and without prefill graphs, plus how
    many steps each padded bucket ran (so the test knows the padded path was taken)."""
    from shared.engine import LLM, SamplingParams
    from shared.engine.attention.triton_backend import TritonAttentionBackend
    from shared.engine.prefill_graph import PrefillGraphs

    results, used = {}, {}
    on_gpu = torch.cuda.is_available()
    for graphs in (False, True):
        llm = LLM(model_dir, dtype="float32", kv_cache_memory=8 << 20, prefill_graph_max_tokens=0,
                  max_num_batched_tokens=256)
        eng = llm.engine
        if not on_gpu:  # the Triton kernels in the interpreter, as a GPU runs them
            eng.backend = eng.runner.backend = TritonAttentionBackend(eng.pool)
        runs = []
        if graphs:
            pg = PrefillGraphs(eng.model, eng.backend, eng.device, max_tokens=128,
                               max_pages=-(-eng.max_model_len // eng.layout.page_size), capture=on_gpu)
            original = pg.run

            def counted(input_ids, positions, meta, _run=original):
                runs.append(pg.bucket_for(meta.slot_mapping.shape[0]))
                return _run(input_ids, positions, meta)
            pg.run = counted
            eng.runner.prefill_graphs = pg
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [[(11 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 40, 70, 100))]
        out = [llm.generate([p], params)[0].token_ids for p in prompts]  # one a step: buckets 64 and 128
        # two sequences in one step (the unused sequences and the padding one both in play)
        pair = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((9, 33))]
        out += [o.token_ids for o in llm.generate(pair, params)]
        # a second turn of the longest prompt: its answer and a new user turn, the prefix cached; the
        # padded steps between must not have written into its pages (their stale slots are -1)
        turn2 = prompts[3] + out[3] + [(5 * j) % 250 + 3 for j in range(20)]
        out += [o.token_ids for o in llm.generate([turn2], params)]
        # ten sequences at once: more than a graph holds, so that step runs eagerly
        many = [[(13 * i + j) % 250 + 3 for j in range(6)] for i in range(10)]
        out += [o.token_ids for o in llm.generate(many, params)]
        eng.check_idle()
        results[graphs] = out
        used[graphs] = runs
    return {"eager": results[False], "graphs": results[True], "buckets_run": used[True]}


def test_prefill_steps_padded_to_a_bucket_give_the_same_tokens(runner, tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                            vocab=256, intermediate=128)
    got = runner(CASE, str(model))
    assert got["graphs"] == got["eager"]
    buckets = got["buckets_run"]
    assert {64, 128} <= set(buckets), buckets  # small and larger steps went through the padded path
    assert len(got["graphs"]) == 17 and all(len(t) == 6 for t in got["graphs"])


def test_token_buckets():
    from shared.engine.prefill_graph import token_buckets
    assert token_buckets(512) == [64, 128, 256, 512]
    assert token_buckets(300) == [64, 128, 256, 300]
    assert token_buckets(32) == [32]
    assert token_buckets(0) == []
