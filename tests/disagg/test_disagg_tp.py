"""Disaggregated serving with tensor parallelism on both sides: a prefill worker and a
decode worker each started with --tp 2 (two processes each, gloo), every rank with its
own NIXL agent over its shard of the KV pool. Prefill rank r writes its pages into decode
rank r, every rank notifies decode rank 0, and decode starts only when all have.

Through the whole stack (real redis-server, router, gateway, official openai client) on a
random-weight Llama with the default model's tokenizer: greedy text equals the offline
engine at TP=1; the bytes prefill sent equal the bytes decode received and equal both
ranks' shards of the prompt's pages; the registry lists one pool and one NIXL metadata
entry per rank; every page is free again afterwards. A prefill worker whose KV layout
differs (another page size) refuses the reservation with FAILED_PRECONDITION and says why
(different TP sizes do pair: tests/disagg/test_disagg_hetero_tp.py)."""
from __future__ import annotations

import json
import math

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.engine_models import build_model_dir
from tests.helpers.stack import ProcessStack, managed, model_dir as default_model_dir, new_log_dir, wait_until

PROMPTS = ["The river bends twice before it reaches the sea, and",
           "List three colours: red, green,",
           " ".join(f"word{i}" for i in range(60))]  # several pages, more than one prefill chunk
MAX_TOKENS = 10
CHUNK = 32


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    # vocab as large as the real tokenizer's, so any prompt it encodes is in range
    return build_model_dir(tmp_path_factory.mktemp("disagg-tp") / "llama", "llama_tied_gqa2",
                           tokenizer_from=default_model_dir(), vocab_size=49152, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def stack(request, tp_model):
    s = ProcessStack(new_log_dir("disagg-tp"), kv_cache_memory="8M",
                     worker_args=["--model", str(tp_model), "--dtype", "float32", "--tp", "2",
                                  "--max-num-batched-tokens", str(CHUNK), "--page-size", "8",
                                  # a cancelled reservation's live writer may still write for
                                  # 2 x write timeout: keep that short for the refusal test
                                  "--write-timeout", "2", "--notice-timeout", "3"],
                     gateway_args=["--model", str(tp_model)],
                     # every request through the prefill worker: this module checks TP transfers
                     router_args=["--local-prefill-max-tokens", "0"])
    with managed(request, s.start(prefill=1, decode=1)) as s:
        s.wait_ready()
        yield s


def offline(tp_model, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    from shared.engine import LLM, SamplingParams
    torch.set_num_threads(1)
    llm = LLM(str(tp_model), dtype="float32")
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


def test_tp2_prefill_and_decode_match_offline_tp1(stack, tp_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tp_model))
    prompts = [tok.encode(p) for p in PROMPTS]
    want = offline(tp_model, prompts)

    entries = stack.workers()
    for wid in ("prefill-0", "decode-0"):
        assert entries[wid]["tp"] == "2"
        assert sorted(p["rank"] for p in json.loads(entries[wid]["kv_pools"])) == [0, 1]
        assert sorted(stack.redis().hkeys(f"duet:worker:{wid}:nixl")) == ["0", "1"]
    page_size = int(entries["decode-0"]["page_size"])
    pools = json.loads(entries["decode-0"]["kv_pools"])
    page_bytes = {p["rank"]: p["page_bytes"] for p in pools}

    # every prefill rank probed the decode ranks it writes to when decode joined (peer_warmup.py);
    # the probes are not KV: the byte counts below are the requests' alone
    wait_until(lambda: stack.metrics("prefill-0").value("duet_kv_peer_connect_seconds_count", outcome="ok") == 1,
               30, "prefill's connection probe of decode-0 (both ranks)")
    sent0 = stack.metrics("prefill-0").value("duet_kv_transfer_bytes_total", direction="sent")
    recv0 = stack.metrics("decode-0").value("duet_kv_transfer_bytes_total", direction="received")
    client = stack.client()
    model = client.models.list().data[0].id
    expected_bytes = 0
    for prompt_text, ids, ref in zip(PROMPTS, prompts, want):
        r = client.completions.create(model=model, prompt=prompt_text, max_tokens=MAX_TOKENS, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(ref)
        assert r.choices[0].text == tok.decode(ref)
        stream = client.completions.create(model=model, prompt=prompt_text, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == tok.decode(ref)
        # the second request hit prefill's prefix cache; decode kept the first one's full pages,
        # so prefill writes only the partly filled last page
        expected_bytes += (2 * math.ceil(len(ids) / page_size) - len(ids) // page_size) * sum(page_bytes.values())

    stack.wait_idle(timeout=30)
    sent = stack.metrics("prefill-0").value("duet_kv_transfer_bytes_total", direction="sent") - sent0
    recv = stack.metrics("decode-0").value("duet_kv_transfer_bytes_total", direction="received") - recv0
    assert sent == recv == expected_bytes
    assert stack.metrics("decode-0").value("duet_kv_recomputes_total") == 0  # every notice came


def test_a_prefill_worker_of_another_kv_layout_refuses_the_reservation(stack, tp_model):
    stack.add_worker("prefill", "prefill-tp1", extra=["--tp", "1", "--page-size", "16"])
    stack.wait_registered(["prefill-tp1"])
    entries = stack.workers()
    with grpc.insecure_channel(entries["decode-0"]["address"]) as dch:
        # the reservation names the mismatched worker as its writer: its capability holds, the layout not
        res = duet_pb2_grpc.DecodeStub(dch).Reserve(duet_pb2.ReserveRequest(
            request_id="tp-mismatch", prompt_tokens=8, max_tokens=2, prefill_worker_id="prefill-tp1"), timeout=30)
        assert [r.rank for r in res.ranks] == [0, 1]
        assert list(res.ranks[0].page_ids) == list(res.ranks[1].page_ids)
        with grpc.insecure_channel(entries["prefill-tp1"]["address"]) as pch:
            with pytest.raises(grpc.RpcError) as err:
                duet_pb2_grpc.PrefillStub(pch).Prefill(duet_pb2.PrefillRequest(
                    request_id="tp-mismatch", prompt_token_ids=list(range(20, 28)), reservation=res,
                    sampling=duet_pb2.SamplingParams(temperature=0, max_tokens=2)), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not match" in err.value.details()
        duet_pb2_grpc.DecodeStub(dch).Cancel(duet_pb2.CancelRequest(
            reservation_id=res.reservation_id, generation=res.generation), timeout=10)
    stack.wait_idle(["decode-0", "prefill-0", "prefill-tp1"], timeout=30)  # freed by its writer's abort notice
