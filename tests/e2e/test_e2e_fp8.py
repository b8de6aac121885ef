"""`duet up -- --quantization fp8 --kv-cache-dtype fp8_e4m3` end to end, split (1 prefill + 1
decode, the KV moved by NIXL) and colocated (--both 1), on the default model.

Everything real (duet up's redis, router, workers, gateway, the openai client). The workers
quantize the model to FP8 at load (on the CPU: dequantized, the numbers an FP8 layer holds)
and keep KV in float8 pages: the registry says so (the KV layout names float8_e4m3fn, a page
is a quarter of a float32 page), the handoff moves those bytes, and split and colocated give
the offline engine's greedy text with the same options."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.stack import DuetUp, managed, model_dir, new_log_dir, offline_outputs, page_bytes, wait_until

FP8 = ("--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3")
MAX_TOKENS = 12
PAGE_SIZE = 16
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION = "The three primary colors are"


def _offline_references():
    """The offline engine with the same options: (chat, completion) answers and the tokenizer."""
    from transformers import AutoTokenizer

    from shared.engine import LLM
    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    chat_ids = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    # one thread, as the workers run (--threads 1): rounding onto the fp8 grid turns a last-bit
    # difference of float32 sums (another thread count, another batch) into a different KV value,
    # and this model's first chat token is a near tie ("The" -1.86, "L" -1.96 with a float32 cache)
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(model_dir()), kv_cache_memory=64 << 20, quantization="fp8", kv_cache_dtype="fp8_e4m3",
                  num_threads=1)
        assert llm.engine.pool.buffer.dtype.itemsize == 1
        # one request at a time, as the stacks get them: a batch of two rounds its sums differently
        (chat,), (completion,) = (offline_outputs(llm, [p], MAX_TOKENS) for p in (chat_ids, tok.encode(COMPLETION)))
    finally:
        torch.set_num_threads(threads)
    return chat, completion, tok


@pytest.fixture(scope="module")
def stacks(request):
    """The split and the colocated stack (started one after the other: two `duet up`s picking
    their children's ports at once can race for one), and the offline references, computed
    while the first boots."""
    split = DuetUp(new_log_dir("up-fp8-split"), worker_args=FP8)
    both = DuetUp(new_log_dir("up-fp8-both"), "--both", "1", "--prefill", "0", "--decode", "0", worker_args=FP8)
    with managed(request, split.start()) as s:
        refs = _offline_references()
        s.wait_ready()
        with managed(request, both.start()) as b:
            yield (s, b.wait_ready()), refs


@pytest.fixture(scope="module")
def references(stacks):
    return stacks[1]


def test_fp8_serves_split_and_colocated_with_the_offline_engines_text(stacks, references):
    chat_ref, completion_ref, _ = references
    for s in stacks[0]:
        model = s.client().models.list().data[0].id
        for entry in s.workers().values():
            assert entry["kv_layout"].endswith("-float8_e4m3fn-heads_first"), entry["kv_layout"]
            for pool in json.loads(entry["kv_pools"]):  # the transfer peers' pools (none colocated)
                assert pool["page_bytes"] == page_bytes(model_dir(), PAGE_SIZE, 1)
        chat = s.client().chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
        assert chat.choices[0].message.content == chat_ref.text
        done = s.client().completions.create(model=model, prompt=COMPLETION, max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].text == completion_ref.text
        s.wait_idle()


def test_the_handoff_moves_fp8_pages(stacks, references):
    """A quarter of the float32 pages' bytes (half of what bf16 pages would move on a GPU)."""
    split = stacks[0][0]
    tok = references[2]
    prefill, decode = split.worker_ids("prefill")[0], split.worker_ids("decode")[0]
    prompt = "Zanzibar's spice markets, described by a careful geographer in exactly forty-one words:"
    pages = math.ceil(len(tok.encode(prompt)) / PAGE_SIZE)
    before = {w: split.metrics(w) for w in (prefill, decode)}
    split.client().completions.create(model=split.client().models.list().data[0].id, prompt=prompt, max_tokens=4,
                                      temperature=0)

    def delta(worker, name, **labels):
        return split.metrics(worker).value(name, **labels) - before[worker].value(name, **labels)

    wait_until(lambda: delta(decode, "duet_kv_transfer_bytes_total", direction="received") > 0, 10,
               "decode's received-bytes counter")
    sent = delta(prefill, "duet_kv_transfer_bytes_total", direction="sent")
    assert sent == delta(decode, "duet_kv_transfer_bytes_total", direction="received")
    assert sent == pages * page_bytes(model_dir(), PAGE_SIZE, 1) == pages * page_bytes(model_dir(), PAGE_SIZE) // 4
    split.wait_idle()
