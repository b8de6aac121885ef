"""Prefill and decode at different tensor-parallel sizes through `duet up --prefill-tp P
--decode-tp D`: the KV is re-sharded by heads on the way (kv_transfer/head_plan.py).

Random-weight Llamas with the default model's tokenizer: one whose 2 KV heads divide both
TP sizes (1 -> 2, 2 -> 1), one with a single KV head, replicated on both TP=2 sides (2 -> 2;
one prefill rank feeding both decode ranks' replicas, 1 -> 2 with one KV head, is covered with
real NIXL agents in tests/disagg/test_kv_transfer_hetero.py). For each: greedy text (plain and streamed) equals the offline TP=1 engine; the
registry shows each worker's TP and a pool per rank holding the right heads; the bytes
prefill sent equal the bytes decode received and equal the request's KV as the decode
worker holds it (its pages x every decode rank's page bytes); decode counted no recompute
(every rank's notice came); every page is free again afterwards."""
from __future__ import annotations

import json
import math

import pytest

from tests.helpers.engine_models import build_model_dir
from tests.helpers.stack import DuetUp, managed, model_dir as default_model_dir, new_log_dir

PROMPTS = ["The river bends twice before it reaches the sea, and",
           " ".join(f"word{i}" for i in range(50))]  # several pages, more than one prefill chunk
MAX_TOKENS = 8
PAGE = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("hetero-tp")
    common = dict(tokenizer_from=default_model_dir(), vocab_size=49152, num_attention_heads=4,
                  max_position_embeddings=1024)
    return {kv: build_model_dir(base / f"kv{kv}", "llama_tied_gqa2", num_key_value_heads=kv, **common)
            for kv in (1, 2)}


@pytest.fixture(scope="module")
def references(models):
    """kv_heads -> (tokenizer, prompts' ids, the offline TP=1 engine's greedy tokens), made once
    for the cases that share a model."""
    made = {}

    def get(kv_heads: int):
        if kv_heads not in made:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(models[kv_heads]))
            prompts = [tok.encode(p) for p in PROMPTS]
            made[kv_heads] = tok, prompts, offline(models[kv_heads], prompts)
        return made[kv_heads]
    return get


def offline(model, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    from shared.engine import LLM, SamplingParams
    torch.set_num_threads(1)
    llm = LLM(str(model), dtype="float32")
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("prefill_tp,decode_tp,kv_heads", [(1, 2, 2), (2, 1, 2), (2, 2, 1)],
                         ids=["1to2", "2to1", "2to2-kv1"])
def test_prefill_and_decode_at_different_tp_match_offline_tp1(request, models, references, prefill_tp, decode_tp,
                                                              kv_heads):
    model = models[kv_heads]
    tok, prompts, want = references(kv_heads)
    up = DuetUp(new_log_dir(f"hetero-{prefill_tp}{decode_tp}-kv{kv_heads}"), "--model", str(model),
                "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), kv_cache_memory="8M",
                worker_args=["--dtype", "float32", "--max-num-batched-tokens", "32", "--page-size", str(PAGE)],
                env={"DUET_LOCAL_PREFILL_MAX_TOKENS": "0"})  # every request through prefill: the TP handoff
    with managed(request, up.start()) as stack:
        stack.wait_ready()
        entries = stack.workers()
        heads = {}
        for wid, tp in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            assert entries[wid]["tp"] == str(tp)
            pools = sorted(json.loads(entries[wid]["kv_pools"]), key=lambda p: p["rank"])
            heads[wid] = [(p["first_head"], p["num_heads"]) for p in pools]
        assert entries["prefill-0"]["compat_hash"] == entries["decode-0"]["compat_hash"]
        expect = {1: {1: [(0, 1)], 2: [(0, 1), (0, 1)]}, 2: {1: [(0, 2)], 2: [(0, 1), (1, 1)]}}[kv_heads]
        assert heads == {"prefill-0": expect[prefill_tp], "decode-0": expect[decode_tp]}
        decode_page_bytes = sum(p["page_bytes"] for p in json.loads(entries["decode-0"]["kv_pools"]))

        client = stack.client()
        mid = client.models.list().data[0].id
        expected_bytes = 0
        for text, ids, ref in zip(PROMPTS, prompts, want):
            r = client.completions.create(model=mid, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
            assert (r.usage.prompt_tokens, r.choices[0].text) == (len(ids), tok.decode(ref))
            stream = client.completions.create(model=mid, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == tok.decode(ref)
            # the repeat: decode kept the first request's full pages, only the last one moves
            expected_bytes += (2 * math.ceil(len(ids) / PAGE) - len(ids) // PAGE) * decode_page_bytes

        stack.wait_idle(timeout=30)
        sent = stack.metrics("prefill-0").value("duet_kv_transfer_bytes_total", direction="sent")
        recv = stack.metrics("decode-0").value("duet_kv_transfer_bytes_total", direction="received")
        assert sent == recv == expected_bytes
        assert stack.metrics("decode-0").value("duet_kv_recomputes_total") == 0
