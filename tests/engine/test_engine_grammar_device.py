"""Constrained decoding on each device there is (CPU always, CUDA when present: pinned
bitmask copies, xgrammar's bitmask kernel, CUDA graphs, the overlap loop, page copies for
n > 1), with nothing but this repository: a random-weight model and the synthetic
vocabulary of tests/helpers/synthetic_vocab.py (no tokenizer files, no jsonschema package),
so it runs on the GPU image as it is:

    python -m pytest -q tests/engine/test_engine_grammar_device.py
"""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.grammar import GrammarBackend
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts
from tests.helpers.synthetic_vocab import synthetic_info

VOCAB = 4096
EOS = 2
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}},
    "required": ["id", "kind", "tags"], "additionalProperties": False}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("grammar-device") / "m", "llama_tied_gqa2", seed=7,
                           vocab_size=VOCAB)


@pytest.fixture(scope="module")
def info():
    return synthetic_info(VOCAB, [EOS])


def run(model_dir, info, device: str, overlap: bool, params: SamplingParams, prompts):
    eng = Engine(model_dir=str(model_dir), device=device, dtype="float32", page_size=4,
                 kv_cache_memory=32 << 20, overlap_schedule=overlap, cuda_graph_max_bs=8)
    eng._grammars = GrammarBackend(None, VOCAB, [EOS], info=info)
    rids = [eng.add_request(p, params) for p in prompts]
    out: dict[tuple[str, int], list[int]] = {}
    finish = {}
    while eng.has_work:
        for o in eng.step():
            out.setdefault((o.rid, o.index), []).extend(o.token_ids)
            if o.finished:
                finish[(o.rid, o.index)] = o.finish_reason
    assert_all_pages_free(eng)
    return [[out[(rid, i)] for i in range(params.n)] for rid in rids], finish


def text(info, tokens: list[int]) -> str:
    vocab = info.decoded_vocab
    return b"".join(vocab[t] if isinstance(vocab[t], bytes) else bytes(vocab[t]) for t in tokens
                    if t != EOS).decode()


def check(obj) -> None:
    assert set(obj) == {"id", "kind", "tags"}
    assert isinstance(obj["id"], int) and 0 <= obj["id"] <= 999 and obj["kind"] in ("cat", "dog")
    assert len(obj["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 4 for t in obj["tags"])


@pytest.mark.parametrize("device", DEVICES)
def test_schema_holds_and_loops_agree(model_dir, info, device):
    prompts = random_prompts(3, [5, 9, 14], vocab=VOCAB, seed=2)
    params = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=120,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    plain, finish = run(model_dir, info, device, False, params, prompts)
    assert set(finish.values()) == {"stop"}
    for seqs in plain:
        for tokens in seqs:
            check(json.loads(text(info, tokens)))
    overlap, _ = run(model_dir, info, device, True, params, prompts)
    assert overlap == plain


def test_fill_one_by_one_and_by_threads_give_the_same_masks(info, monkeypatch):
    """GrammarBackend.fill goes row by row and hands the rest to xgrammar's threads once
    rows turn out expensive: both paths fill the same bits, and rows with no live matcher
    stay all-ones."""
    import shared.engine.grammar as grammar_mod

    backend = GrammarBackend(None, VOCAB, [EOS], info=info)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prefixes = [b'', b'{"id": 1', b'{"id": 12, "kind": "c', b'{"id": 3, "kind": "dog", "tags": ["ab']
    states = []
    for i in range(12):
        state = backend.new_state(spec)
        for byte in prefixes[i % len(prefixes)]:
            assert state.accept(byte)  # the synthetic vocabulary starts with the 256 bytes
        states.append(state)
    states[5] = None  # a free row in the batch
    masks = {}
    for budget in (10.0, 0.0):  # everything one by one; threads after the first row
        monkeypatch.setattr(grammar_mod, "SERIAL_FILL_BUDGET_S", budget)
        bitmask = backend.alloc_bitmask(len(states), pin=False)
        rows = backend.fill(states, bitmask)
        assert rows == [i for i in range(12) if i != 5]
        masks[budget] = bitmask
    assert torch.equal(masks[10.0], masks[0.0])
    assert torch.all(masks[0.0][5] == -1)
    assert not torch.equal(masks[0.0][0], masks[0.0][1])  # different states, different masks
