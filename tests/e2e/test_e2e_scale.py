"""The split serving path at a small scale: 2 prefill + 2 decode workers (separate processes over one real
redis-server, router and gateway), 32 concurrent streaming clients through the official
openai client; every answer equals the offline engine's, every worker served some, a
prefill and a decode worker started later join and get traffic, and every worker's KV
usage returns to 0 when the load ends."""
from __future__ import annotations

import asyncio

import pytest

from tests.helpers.openai_schema import validate
from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, offline_llm, offline_outputs

MAX_TOKENS = 16
PROMPTS = [
    "The capital of Italy is",
    "One, two, three,",
    "My favourite fruit is",
    "The opposite of hot is",
    "Water boils at",
    "A haiku about autumn:",
    "The largest planet is",
    "Python is a programming language that",
]


@pytest.fixture(scope="module")
def stack(request):
    with managed(request, ProcessStack(new_log_dir("scale")).start(prefill=2, decode=2)) as s:
        yield s


@pytest.fixture(scope="module")
def expected(stack):
    """Offline greedy texts (computed while the workers load)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    outs = offline_outputs(offline_llm(model_dir()), [tok.encode(p) for p in PROMPTS], MAX_TOKENS)
    stack.wait_ready()
    return {p: o.text for p, o in zip(PROMPTS, outs)}


async def stream_one(client, model: str, prompt: str) -> str:
    pieces = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        validate(chunk.model_dump(exclude_unset=True), "CreateCompletionStreamResponse")
        pieces.extend(c.text for c in chunk.choices)
    return "".join(pieces)


def run_wave(stack, prompts: list[str]) -> list[str]:
    async def wave():
        async with stack.async_client(timeout=180) as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(stream_one(client, model, p) for p in prompts))
    return asyncio.run(wave())


def served(stack, worker_id: str) -> float:
    m = stack.metrics(worker_id)
    return m.value("duet_requests_total", outcome="ok")


def test_concurrent_streams_are_right_and_spread_over_every_worker(stack, expected):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    late = [("prefill", "prefill-late"), ("decode", "decode-late")]
    for role, wid in late:  # joins while the first wave runs
        stack.add_worker(role, wid)
    answers = run_wave(stack, prompts)
    assert answers == [expected[p] for p in prompts]
    first = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    counts = {w: served(stack, w) for w in first}
    assert all(n > 0 for n in counts.values()), counts
    for w in first:
        role = "sent" if w.startswith("prefill") else "received"
        assert stack.metrics(w).value("duet_kv_transfer_bytes_total", direction=role) > 0, w
    assert sum(counts[w] for w in first if w.startswith("decode")) == 32

    stack.wait_registered([wid for _, wid in late])
    answers = run_wave(stack, prompts[:16])
    assert answers == [expected[p] for p in prompts[:16]]
    late_counts = {wid: served(stack, wid) for _, wid in late}
    assert all(n > 0 for n in late_counts.values()), late_counts
    assert set(stack.worker_ids()) == set(first) | {wid for _, wid in late}
    stack.wait_idle(timeout=30)
