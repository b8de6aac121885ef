"""A mixture-of-experts model served disaggregated by `duet up` (one prefill and one decode
worker): greedy text through the official openai client equals the offline engine and
transformers, the KV bytes prefill sent equal the bytes decode received (and the prompt's
pages), decode recomputed nothing, and every page is free afterwards.

A random-weight Qwen3-MoE (8 experts, top-3, a dense layer beside an MoE one) with the
default model's tokenizer, float32 on CPU."""
from __future__ import annotations

import math

import pytest

from tests.helpers.engine_models import build_model_dir
from tests.helpers.stack import (DuetUp, managed, model_dir as default_model_dir, new_log_dir, offline_llm,
                         offline_outputs, page_bytes, transformers_greedy)

PROMPTS = ["Experts are chosen per token, and", " ".join(f"w{i}" for i in range(40))]
MAX_TOKENS = 8
PAGE = 8


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("disagg-moe") / "qwen3-moe", "qwen3_moe",
                           tokenizer_from=default_model_dir(), vocab_size=49152,
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def stack(request, moe_model):
    up = DuetUp(new_log_dir("up-moe"), "--model", str(moe_model), "--prefill", "1", "--decode", "1",
                kv_cache_memory="8M", worker_args=["--dtype", "float32", "--page-size", str(PAGE),
                                                   "--max-num-batched-tokens", "16"])
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


def test_moe_split_serving_matches_offline_and_transformers(stack, moe_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(moe_model))
    ids = [tok.encode(p) for p in PROMPTS]
    want = offline_outputs(offline_llm(moe_model), ids, MAX_TOKENS)
    assert [w.token_ids for w in want] == transformers_greedy(moe_model, ids, MAX_TOKENS)

    workers = stack.workers()
    prefill = next(w for w, e in workers.items() if e["role"] == "prefill")
    decode = next(w for w, e in workers.items() if e["role"] == "decode")
    client = stack.client()
    model = client.models.list().data[0].id
    for text, prompt, ref in zip(PROMPTS, ids, want):
        r = client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref.token_ids)

    stack.wait_idle(timeout=30)
    sent = stack.metrics(prefill).value("duet_kv_transfer_bytes_total", direction="sent")
    recv = stack.metrics(decode).value("duet_kv_transfer_bytes_total", direction="received")
    pages = sum(math.ceil(len(p) / PAGE) for p in ids)
    assert sent == recv == pages * page_bytes(moe_model, PAGE)
    assert stack.metrics(decode).value("duet_kv_recomputes_total") == 0
