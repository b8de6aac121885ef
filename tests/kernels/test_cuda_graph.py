"""Decode CUDA graphs (GPU only): same greedy tokens with graphs on and off, with batch
sizes that pad up to a captured size and batches larger than the largest graph."""
from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.cuda_graph import batch_size_ladder

from tests.helpers.tiny_models import make_tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_ladder_covers_every_size():
    sizes = batch_size_ladder(100)
    assert sizes[0] == 1 and sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert batch_size_ladder(1) == [1]


@cuda
@pytest.mark.parametrize("family,dtype", [("qwen3", "bfloat16"), ("llama", "float32")])
def test_graphs_on_and_off_give_the_same_tokens(tmp_path, family, dtype):
    model = make_tiny_model(tmp_path / family, family, hidden=128, layers=3, heads=8, kv_heads=2,
                            head_dim=32, vocab=512, intermediate=256)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(7)]
    runs = {}
    for graphs in (True, False):
        llm = LLM(str(model), dtype=dtype, cuda_graph=graphs, cuda_graph_max_bs=4, kv_cache_memory=64 << 20)
        eng = llm.engine
        assert eng.backend.name == "triton" and eng.runner.graphs.capture is graphs
        if graphs:
            assert eng.runner.graphs.sizes == [1, 2, 4]
        runs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        eng.check_idle()
        del llm, eng
        torch.cuda.empty_cache()
    assert runs[True] == runs[False]
    assert [len(t) for t in runs[True]] == [8 + 5 * i for i in range(7)]
