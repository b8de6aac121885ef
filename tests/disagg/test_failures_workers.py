"""Failure rules when workers die or a completion notice never comes, on 2 prefill + 2
decode workers (separate processes, real redis-server, router, gateway, NIXL/UCX):

* a missing completion notice past the deadline makes decode recompute the prompt, and
  the answer is still right (driven over decode's own gRPC API: through the gateway the
  notice always precedes Generate, so the test plays a gateway whose prefill never wrote);
* a reservation whose held prefix is not the prompt prefill computes is never read: prefill
  declines it and decode recomputes (the test plays a gateway that sends another prompt);
* a decode worker SIGKILLed while prefill writes into its reservation: prefill's writes
  fail and it frees its pages, the client gets a clean OpenAI error, the router stops
  choosing the dead worker once its registry TTL passes, later requests succeed;
* a prefill worker SIGKILLed after decode reserved for it: decode keeps the reserved
  pages while the writer is still in the registry, frees them once it is gone, and the
  stack keeps serving.

The gateway runs with failover off (--migration-limit 0): these are the rules under the error a
client sees; with failover on, a request whose worker died goes on elsewhere
(tests/gateway/test_gateway_failover.py, tests/e2e/test_e2e_failover.py).

The tests run in order (each leaves fewer workers). After each, used pages return to zero.
The rules and the other tests that prove them: docs/ARCHITECTURE.md, "Failure rules".
"""
from __future__ import annotations

import math
import time

import grpc
import openai
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.failure_probes import CHUNK, frozen_mid_prefill, holder, long_request
from tests.helpers.openai_schema import validate
from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, offline_llm, offline_outputs, wait_until

TTL_S = 4.0
NOTICE_TIMEOUT_S = 3.0
WRITE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("fail-workers"), registry_ttl_s=TTL_S, kv_cache_memory="320M",
                     gateway_args=["--migration-limit", "0"],
                     worker_args=["--max-num-batched-tokens", str(CHUNK), "--notice-timeout", str(NOTICE_TIMEOUT_S),
                                  "--write-timeout", str(WRITE_TIMEOUT_S)])
    with managed(request, s.start(prefill=2, decode=2)) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(stack):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


@pytest.fixture(scope="module")
def ready(stack, tokenizer):
    stack.wait_ready()
    return stack


@pytest.fixture(scope="module")
def model(ready):
    return ready.client().models.list().data[0].id


def assert_clean_error(exc):
    assert isinstance(exc, openai.APIStatusError), repr(exc)
    assert exc.status_code == 503, (exc.status_code, exc.message)
    validate(exc.response.json(), "ErrorResponse")


def test_missing_notice_makes_decode_recompute_the_prefill(ready, tokenizer):
    stack = ready
    prompt = tokenizer.encode("The tallest mountain in the world is")
    ref = offline_outputs(offline_llm(model_dir()), [prompt], 8)[0]
    decode = "decode-0"
    entry = stack.workers()[decode]
    before = stack.metrics(decode)
    sampling = duet_pb2.SamplingParams(temperature=0, max_tokens=8)
    with grpc.insecure_channel(entry["address"]) as channel:
        stub = duet_pb2_grpc.DecodeStub(channel)
        # decode reserves for prefill-0, which is live but never writes and never sends the notice
        res = stub.Reserve(duet_pb2.ReserveRequest(request_id="no-notice-1", prompt_tokens=len(prompt),
                                                   max_tokens=8, prefill_worker_id="prefill-0"), timeout=30)
        assert len(res.ranks[0].page_ids) == math.ceil(len(prompt) / int(entry["page_size"]))
        started = time.monotonic()
        tokens = [ref.token_ids[0]]  # the first token, as prefill would have sampled it
        for chunk in stub.Generate(duet_pb2.GenerateRequest(
                request_id="no-notice-1", prompt_token_ids=prompt, sampling=sampling, reservation=res,
                prefill_worker_id="prefill-0", first_token=duet_pb2.Token(id=ref.token_ids[0])), timeout=120):
            tokens += [t.id for t in chunk.tokens]
        waited = time.monotonic() - started
    assert tokens == ref.token_ids
    assert waited >= NOTICE_TIMEOUT_S - 0.1  # it waited for the notice until the deadline
    wait_until(lambda: stack.metrics(decode).value("duet_kv_recomputes_total")
               - before.value("duet_kv_recomputes_total") == 1, 5, "the recompute counter")
    # decode computed the prompt itself (plus, as always, one step per later token); the
    # engine files the recomputed prompt under phase="decode" (it has an output prefix)
    def computed():
        return (stack.metrics(decode).value("duet_engine_tokens_computed_total")
                - before.value("duet_engine_tokens_computed_total"))
    expected = len(prompt) + len(ref.token_ids) - 1
    wait_until(lambda: computed() >= expected, 5, "decode's computed-token counter")
    assert computed() == expected
    stack.wait_idle(timeout=30)  # the abandoned reservation is freed too (writer silent past the deadline)


def test_unclaimed_reservation_is_freed_after_the_claim_timeout(ready, tokenizer):
    """A gateway that dies between prefill's answer and Generate: decode got the KV and
    the done notice but nobody claims the reservation; it is freed `--notice-timeout`
    later instead of holding the pages forever."""
    stack = ready
    prompt = tokenizer.encode("A reservation nobody claims, written by prefill all the same.")
    entries = stack.workers()
    before = stack.metrics("decode-1").value("duet_kv_transfer_bytes_total", direction="received")
    with grpc.insecure_channel(entries["decode-1"]["address"]) as dch, \
            grpc.insecure_channel(entries["prefill-1"]["address"]) as pch:
        res = duet_pb2_grpc.DecodeStub(dch).Reserve(duet_pb2.ReserveRequest(
            request_id="unclaimed-1", prompt_tokens=len(prompt), max_tokens=4, prefill_worker_id="prefill-1"),
            timeout=30)
        reply = duet_pb2_grpc.PrefillStub(pch).Prefill(duet_pb2.PrefillRequest(
            request_id="unclaimed-1", prompt_token_ids=prompt, reservation=res,
            sampling=duet_pb2.SamplingParams(temperature=0, max_tokens=4)), timeout=60)
    done_at = time.monotonic()
    assert reply.kv_bytes_sent > 0
    wait_until(lambda: stack.metrics("decode-1").value("duet_kv_transfer_bytes_total", direction="received")
               - before == reply.kv_bytes_sent, 5, "decode to receive the done notice")
    assert stack.kv_usage("decode-1") > 0  # held: a Generate may still come
    stack.wait_idle(["decode-1", "prefill-1"], timeout=NOTICE_TIMEOUT_S + 10)
    assert time.monotonic() - done_at >= NOTICE_TIMEOUT_S - 1.0
    assert "was never claimed" in stack.procs["decode-1"].log_text()


def test_a_held_prefix_that_is_not_the_prompts_makes_decode_recompute(ready, tokenizer):
    """Decode holds the leading pages of prompt A (a finished request). A reservation made
    for A names them; prefill, asked with prompt B, finds their hashes are not its prompt's:
    it writes nothing, sends a declined notice and still answers with B's first token. Decode
    keeps the reservation for the Generate that follows, which recomputes B: the answer is
    B's, never one read from A's pages."""
    stack = ready
    a = tokenizer.encode("Held pages belong to the first prompt of this test. It is long enough to fill two "
                         "whole pages of sixteen tokens each, and then it goes on for a few more words, so "
                         "that the last page is only partly filled when the prompt ends here.")
    assert len(a) > 40
    b = [a[0], *(t + 1 for t in a[1:])]  # same length, another prompt from its second token on
    ref_a, ref_b = offline_outputs(offline_llm(model_dir()), [a, b], 6)
    decode, writer = "decode-0", "prefill-0"
    entries = stack.workers()
    sampling = duet_pb2.SamplingParams(temperature=0, max_tokens=6)
    with grpc.insecure_channel(entries[decode]["address"]) as dch, \
            grpc.insecure_channel(entries[writer]["address"]) as pch:
        dstub, pstub = duet_pb2_grpc.DecodeStub(dch), duet_pb2_grpc.PrefillStub(pch)

        def split(rid: str, prompt: list[int], reserve_for: list[int]):
            """Reserve (for the prompt reserve_for), Prefill and Generate prompt, as a gateway does."""
            res = dstub.Reserve(duet_pb2.ReserveRequest(request_id=rid, prompt_tokens=len(reserve_for), max_tokens=6,
                                                        prefill_worker_id=writer, prompt_token_ids=reserve_for),
                                timeout=30)
            reply = pstub.Prefill(duet_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                          reservation=res), timeout=60)
            tokens = [reply.first_token.id]
            for chunk in dstub.Generate(duet_pb2.GenerateRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=res,
                    prefill_worker_id=writer, first_token=reply.first_token), timeout=60):
                tokens += [t.id for t in chunk.tokens]
            return res, reply, tokens

        res, reply, tokens = split("held-a", a, a)
        assert tokens == ref_a.token_ids and res.held_pages == 0 and reply.kv_bytes_sent > 0
        before = stack.metrics(decode).value("duet_kv_recomputes_total")
        res, reply, tokens = split("held-b", b, a)  # decode holds A's pages: the reservation names them
        assert res.held_pages >= 2 and reply.kv_bytes_sent == 0
        assert tokens == ref_b.token_ids
    wait_until(lambda: stack.metrics(decode).value("duet_kv_recomputes_total") - before == 1, 5,
               "the recompute counter")
    assert "did not arrive (declined)" in stack.procs[decode].log_text()
    assert "are not this prompt's" in stack.procs[writer].log_text()
    stack.wait_idle([decode, writer], timeout=30)


def test_decode_killed_while_prefill_writes(ready, model):
    stack = ready
    decodes = stack.worker_ids("decode")
    prefills = stack.worker_ids("prefill")
    errors_before = {p: stack.metrics(p).value("duet_requests_total", outcome="error") for p in prefills}
    request = long_request(stack, model)
    victim = holder(stack, decodes, "a decode reservation for the long prompt")
    writer = holder(stack, prefills, "the prefill worker computing the long prompt")
    with frozen_mid_prefill(stack, writer, request):
        stack.kill(victim)
    killed_at = time.monotonic()
    request.join(timeout=60)
    assert request.error is not None, "the request should fail: its decode worker died"
    assert_clean_error(request.error)
    survivors = [w for w in stack.known_workers() if w != victim]
    # prefill's writes failed (it counts only a failed KV transfer as an error) and it
    # freed its pages
    wait_until(lambda: stack.metrics(writer).value("duet_requests_total", outcome="error")
               > errors_before[writer], 30, "prefill to fail the request")
    stack.wait_idle(survivors, timeout=30)
    # the dead worker leaves the registry by TTL; then the router no longer picks it
    wait_until(lambda: victim not in stack.workers(), TTL_S + 10, f"{victim} to leave the registry")
    assert time.monotonic() - killed_at >= 1.0
    time.sleep(1.5)  # one watcher scan
    survivor = next(d for d in decodes if d != victim)
    ok_before = stack.metrics(survivor).value("duet_requests_total", outcome="ok")
    client = stack.client()
    for i in range(4):
        r = client.completions.create(model=model, prompt=f"Fact {i}: the sun is", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    wait_until(lambda: stack.metrics(survivor).value("duet_requests_total", outcome="ok") - ok_before == 4,
               5, "the surviving decode to serve the next requests")
    stack.wait_idle(survivors, timeout=30)


def test_prefill_killed_after_reservation(ready, model):
    stack = ready
    decodes = stack.worker_ids("decode")
    prefills = stack.worker_ids("prefill")
    assert len(prefills) == 2 and len(decodes) == 1
    request = long_request(stack, model)
    reserved_on = holder(stack, decodes, "the decode reservation")
    victim = holder(stack, prefills, "the prefill worker computing the long prompt")
    with frozen_mid_prefill(stack, victim, request):
        stack.kill(victim)
    request.join(timeout=60)
    assert request.error is not None, "the request should fail: its prefill worker died"
    assert_clean_error(request.error)
    # while the dead writer is still registered a write could still land: pages stay reserved
    checks = 0
    while victim in stack.workers():
        assert stack.kv_usage(reserved_on) > 0, "reserved pages freed while their writer was still registered"
        checks += 1
        time.sleep(0.2)
    assert checks >= 1
    survivors = [w for w in stack.known_workers() if w != victim and w in stack.workers()]
    stack.wait_idle(survivors, timeout=20)  # writer gone from the registry: freed
    time.sleep(1.5)  # one watcher scan: the router forgets the dead prefill worker
    client = stack.client()
    for i in range(2):
        r = client.completions.create(model=model, prompt=f"Rule {i}: always", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
    stack.wait_idle(survivors, timeout=20)
