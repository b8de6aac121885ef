"""A worker's host KV tier keeps what is worth keeping, and its /metrics says what it wrote
back and what it dropped, and why: one `both` worker process over gRPC (Decode.Generate
without a reservation), a device pool of a few dozen pages over a host tier.

One-off prompts fill the device and leave it without a copy (`not_reused`); a chat's turns
each extend the last one, so what a turn inserts is kept (`conversation`, and `hit` once the
next turn found it) and the chat's later turns read it back from the host tier. Bytes are
the pages' bytes, and once idle no host page is unaccounted for."""
from __future__ import annotations

import re
import uuid

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, page_bytes, wait_until

WORKER = "both-0"


@pytest.fixture(scope="module")
def stack(request):
    # ~29 pages of 16 tokens on the device, 256 MiB of host tier
    s = ProcessStack(new_log_dir("host-tier-writes"), kv_cache_memory="22M")
    with managed(request, s):
        s.start_redis()
        s.add_worker("both", WORKER, extra=["--kv-host-memory", "256M"])
        s.wait_registered([WORKER])
        yield s


def generate(stub, prompt: list[int], max_tokens: int = 8) -> list[int]:
    sampling = duet_pb2.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens, ignore_eos=True)
    tokens = []
    for chunk in stub.Generate(duet_pb2.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                                        sampling=sampling), timeout=300):
        tokens.extend(t.id for t in chunk.tokens)
    return tokens


def test_write_back_keeps_the_conversation_and_says_why_in_metrics(stack):
    entry = stack.workers()[WORKER]
    with grpc.insecure_channel(entry["address"]) as channel:
        stub = duet_pb2_grpc.DecodeStub(channel)
        chat = [(37 * i) % 5000 + 100 for i in range(120)]
        for turn in range(4):
            answer = generate(stub, chat)
            for k in range(3):  # one-off prompts push the chat off the device between turns
                generate(stub, [(53 * i + 977 * (4 * turn + k)) % 5000 + 100 for i in range(150)], max_tokens=2)
            chat = chat + answer + [(11 * i + turn) % 5000 + 100 for i in range(20)]
    stack.wait_idle([WORKER])

    def counted(decision: str, reason: str) -> float:
        return stack.metrics(WORKER).value("duet_kv_host_writeback_pages_total", decision=decision, reason=reason)
    # the counters are exported by the worker's load loop: wait for its next beat
    wait_until(lambda: counted("written", "conversation") + counted("written", "hit") > 0, 10, "written pages")
    # 3 of the 16 prompts continued an earlier one (too few requests yet to call the traffic chats)
    share = lambda: stack.metrics(WORKER).value("duet_kv_host_continued_share")  # noqa: E731
    try:
        wait_until(lambda: abs(share() - 3 / 16) < 0.01, 30, "the continued share of 3 in 16")
    except TimeoutError:
        pytest.fail(f"duet_kv_host_continued_share {share()}, not 3 in 16")
    m = stack.metrics(WORKER)
    assert m.value("duet_kv_host_writeback_pages_total", decision="written", reason="chat_traffic") == 0
    dropped = m.value("duet_kv_host_writeback_pages_total", decision="dropped", reason="not_reused")
    assert dropped > 0, "the one-off prompts were written back"
    assert m.value("duet_kv_cache_hit_tokens_total", tier="host") > 0, "the chat never came back from the host tier"
    per_page = page_bytes(model_dir(), int(entry["page_size"]))
    for decision, reason, _ in [(lab["decision"], lab["reason"], v) for n, lab, v in m.samples
                                if n == "duet_kv_host_writeback_pages_total"]:
        pages = m.value("duet_kv_host_writeback_pages_total", decision=decision, reason=reason)
        assert m.value("duet_kv_host_writeback_bytes_total", decision=decision, reason=reason) == pages * per_page
    assert m.value("duet_kv_host_writeback_pages_total", decision="dropped", reason="copy_in_flight") == 0
    assert m.value("duet_kv_unaccounted_pages", tier="host") == 0
    # the tier's size and how much of it is in use: a CPU tier needs no page-locking, all of it at once
    allocated = m.value("duet_kv_host_tier_pages", state="allocated")
    assert allocated > 0 and m.value("duet_kv_host_tier_pages", state="usable") == allocated


def test_the_worker_logs_its_start_up_by_phase(stack):
    line = next(x for x in stack.procs[WORKER].log_text().splitlines() if "start-up by phase:" in x)
    phases = re.findall(r"([a-z -]+?) (\d+\.\d)s", line.split("start-up by phase:", 1)[1].split(";")[0])
    names = [name.strip(" ,") for name, _ in phases]
    assert names == ["process", "model files", "device", "weights", "lora", "kv pool", "host tier", "graphs", "warm-up",
                     "calibration", "role", "registration"], line
    assert re.search(r"; ready \d+\.\ds after the process began$", line), line
