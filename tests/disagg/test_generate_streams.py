"""Decode.GenerateStreams on a real `both` worker (its own process, the default model on the
CPU, real gRPC), driven by the gateway's GenerateMux: many streams over one call answer what
a Generate call each answers and what the offline engine answers, batched about a message per
engine step; a refused stream and a cancelled one end alone, and the cancelled one's pages are
freed while the others run on. (The gateway's whole path over it runs in every e2e test.)"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from services.gateway.backends.generate_mux import GenerateMux
from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, offline_llm, offline_outputs

MAX_TOKENS = 10
WORKER = "both-0"


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("generate-streams"), kv_cache_memory="128M")
    with managed(request, s.start(prefill=0, decode=0, both=1)) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    texts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(12)]
    texts += ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
    return [tok.encode(t) for t in texts]


def generate(rid: str, prompt, max_tokens: int = MAX_TOKENS) -> duet_pb2.GenerateRequest:
    return duet_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                    sampling=duet_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


async def tokens_of(stream) -> list[int]:
    return [t.id async for chunk in stream for t in chunk.tokens]


def test_streams_over_one_call_answer_as_a_call_each_batched_per_step(stack, prompts):
    address = stack.workers()[WORKER]["address"]
    reference = [r.token_ids for r in offline_outputs(offline_llm(model_dir()), prompts, MAX_TOKENS)]

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = duet_pb2_grpc.DecodeStub(channel)
            each = await asyncio.gather(*(tokens_of(stub.Generate(generate(f"each-{i}", p)))
                                          for i, p in enumerate(prompts)))
            mux = GenerateMux(channel)
            muxed = await asyncio.gather(*(tokens_of(mux.open(generate(f"mux-{i}", p)))
                                           for i, p in enumerate(prompts)))
            await mux.close()
        return each, muxed, mux

    each, muxed, mux = asyncio.run(asyncio.wait_for(main(), 300))
    assert muxed == each == reference
    assert mux.calls == 1 and mux.open_streams == 0
    # 16 streams of 10 tokens: 16 x 10 chunks at most (a step's tokens go out as one chunk per
    # stream) plus 16 ends, in about a message per step: ~10 steps once all have joined
    assert mux.pieces >= len(prompts) + sum(len(t) for t in reference) // 4
    assert mux.replies * 3 <= mux.pieces, (mux.replies, mux.pieces)


def test_a_refused_and_a_cancelled_stream_end_alone_and_free_their_pages(stack, prompts):
    address = stack.workers()[WORKER]["address"]
    reference = offline_outputs(offline_llm(model_dir()), [prompts[12]], MAX_TOKENS)[0].token_ids
    before = stack.metrics(WORKER)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            mux = GenerateMux(channel)
            refused = mux.open(generate("too-long", [1] * 100_000))
            long = mux.open(generate("left", prompts[13], max_tokens=1000))  # seconds of decoding on this CPU
            kept = mux.open(generate("kept", prompts[12]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens_of(refused)
            first = await long.__anext__()
            long.cancel()
            tokens = await tokens_of(kept)
            await mux.close()
        return err.value, first, tokens

    err, first, tokens = asyncio.run(asyncio.wait_for(main(), 300))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "100000" in err.details()
    assert first.tokens and tokens == reference
    # the cancelled stream's request ended on the worker (1,000 tokens would take far longer)
    stack.wait_idle([WORKER], timeout=10)
    after = stack.metrics(WORKER)
    finished = lambda outcome: (after.value("duet_requests_total", endpoint="Generate", outcome=outcome)  # noqa: E731
                                - before.value("duet_requests_total", endpoint="Generate", outcome=outcome))
    assert (finished("ok"), finished("cancelled")) == (1, 1)
