"""Small prefill steps and mixed steps (a prompt beside decode rows) through PrefillGraphs
(shared/engine/prefill_graph.py): the padded step (unused sequences with no tokens, the padding
sequence taking the bucket's remaining tokens over the padding page, slot -1, the attention
over the graph's work list) gives the greedy tokens of the same steps run unpadded.

Both runs use the Triton attention kernels (on CPU under Triton's interpreter, in a child
process: tests/helpers/kernel_runner.py); the padded shapes run eagerly (capture=False), which
is what a captured graph replays, and on a GPU the graphs themselves are captured and replayed.
Prompts cover several token buckets, a second turn whose prefix is cached, prompts admitted
while earlier ones decode (mixed steps of more sequences than the 8 a graph held before), and
a batch of more sequences than a graph holds (eager)."""
from __future__ import annotations

import torch

from tests.helpers.tiny_models import make_tiny_model

CASE = "tests.engine.test_prefill_graph:greedy_with_and_without"


def greedy_with_and_without(model_dir: str) -> dict:
    """{graphs: [tokens per request]} for the engine with and without prefill graphs, plus the
    steps the padded path ran: (bucket, sequences, longest extend, shortest extend)."""
    from shared.engine import LLM, SamplingParams
    from shared.engine.attention.triton_backend import TritonAttentionBackend
    from shared.engine.prefill_graph import PrefillGraphs, graph_seqs

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
            pg = PrefillGraphs(eng.model, eng.backend, eng.device, max_tokens=256,
                               max_pages=-(-eng.max_model_len // eng.layout.page_size), capture=on_gpu,
                               max_seqs=graph_seqs(256, 16))  # 16 decode rows and 8 prompts
            original = pg.run

            def counted(input_ids, positions, meta, _run=original):
                ext = meta.extend_lens_host
                runs.append((pg.bucket_for(meta.slot_mapping.shape[0]), meta.batch_size, max(ext), min(ext)))
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
        # twelve 40-token prompts over a 256-token step budget: the first six decode while the
        # rest are admitted, so steps carry prompts beside decode rows (mixed steps)
        mixed = [[(17 * i + 5 * j) % 250 + 3 for j in range(40)] for i in range(12)]
        out += [o.token_ids for o in llm.generate(mixed, SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))]
        # thirty sequences at once: more than a graph holds, so that step runs eagerly
        many = [[(13 * i + j) % 250 + 3 for j in range(6)] for i in range(30)]
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
    runs = got["buckets_run"]
    assert {64, 128} <= {bucket for bucket, *_ in runs}, runs  # small and larger steps went through the padded path
    # mixed steps: decode rows (one token) beside a prompt, more sequences than 8
    assert any(shortest == 1 and longest > 1 and seqs > 8 for _, seqs, longest, shortest in runs), runs
    assert all(seqs <= 24 for _, seqs, _, _ in runs)  # the thirty went eagerly
    assert len(got["graphs"]) == 7 + 12 + 30
    assert all(len(t) == 6 for t in got["graphs"][:7] + got["graphs"][19:])
    assert all(len(t) == 12 for t in got["graphs"][7:19])


def test_token_buckets():
    from shared.engine.prefill_graph import token_buckets
    assert token_buckets(512) == [64, 128, 192, 256, 320, 384, 448, 512]  # every 64 up to 512
    assert token_buckets(300) == [64, 128, 192, 256, 300]
    assert token_buckets(2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(32) == [32]
    assert token_buckets(0) == []


def test_a_graph_holds_the_decode_graphs_rows_and_eight_prompts_at_most_one_a_token():
    from shared.engine.prefill_graph import graph_seqs
    assert graph_seqs(512, 256) == 264
    assert graph_seqs(128, 256) == 128
    assert graph_seqs(512, 0) == 8  # a prefill worker: no decode rows
