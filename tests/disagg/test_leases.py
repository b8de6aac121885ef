"""Leases on what a peer holds for a request (docs/ARCHITECTURE.md, rule `lease-lapses-freed`),
on 1 prefill + 1 decode worker (separate processes, real redis-server, router, gateway,
NIXL/UCX):

* a reservation nobody renews (a client playing the gateway that simply stops) is quarantined
  when its lease lapses and revoked at its writer, which refuses it and says so: the pages come
  back within the lease, long before the capability's lifetime; one written by prefill that
  nobody claims is freed at once when its lease lapses;
* a holder that renews keeps its reservation past several leases, and it still serves; the
  gateway renews its reservations while prefill computes;
* a gateway SIGSTOPped while prefill writes strands no pages: its reservation's lease lapses,
  decode quarantines and revokes it, prefill cancels the transfer, and both free their pages
  once the writes in flight settled;
* a transfer into a decode worker that is stopped (gone from the registry, taking no write) is
  cancelled on both sides when its lease lapses: prefill stops and frees its pages once the
  writes in flight settled, decode frees the reservation, nothing leaks.

The gateway runs with failover off (--migration-limit 0): a request that lost its reservation
or its transfer ends with a clean error instead of moving on. Each lapse is counted in
`duet_lease_expiries_total{kind}`."""
from __future__ import annotations

import contextlib
import signal
import time

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.failure_probes import CHUNK, frozen_mid_prefill, holder, long_request
from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, offline_llm, offline_outputs, wait_until

REGISTRY_TTL_S = 5.0
LEASE_S = 1.5
NOTICE_TIMEOUT_S = 8.0
WRITE_TIMEOUT_S = 10.0
QUARANTINE_S = max(2 * WRITE_TIMEOUT_S, NOTICE_TIMEOUT_S)
DECODE, PREFILL = "decode-0", "prefill-0"
SAMPLING = duet_pb2.SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def ready(request):
    """The stack, up and serving."""
    s = ProcessStack(new_log_dir("leases"), registry_ttl_s=REGISTRY_TTL_S, kv_cache_memory="320M",
                     gateway_args=["--migration-limit", "0"],
                     worker_args=["--max-num-batched-tokens", str(CHUNK), "--lease-ttl", str(LEASE_S),
                                  "--notice-timeout", str(NOTICE_TIMEOUT_S), "--write-timeout", str(WRITE_TIMEOUT_S)])
    with managed(request, s.start(prefill=1, decode=1)) as s:
        yield s.wait_ready()


@pytest.fixture(scope="module")
def tokenizer(ready):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


@pytest.fixture(scope="module")
def model(ready):
    return ready.client().models.list().data[0].id


def lapses(stack, worker: str, kind: str) -> float:
    return stack.metrics(worker).value("duet_lease_expiries_total", kind=kind)


def reserve(stub, rid: str, prompt: list[int]) -> duet_pb2.Reservation:
    return stub.Reserve(duet_pb2.ReserveRequest(request_id=rid, prompt_tokens=len(prompt), max_tokens=4,
                                                prefill_worker_id=PREFILL), timeout=30)


@contextlib.contextmanager
def stubs(stack):
    """A client playing the gateway: the decode and the prefill worker's stubs."""
    entries = stack.workers()
    with grpc.insecure_channel(entries[DECODE]["address"]) as dch, \
            grpc.insecure_channel(entries[PREFILL]["address"]) as pch:
        yield duet_pb2_grpc.DecodeStub(dch), duet_pb2_grpc.PrefillStub(pch)


def prefill(stub, rid: str, prompt: list[int], res: duet_pb2.Reservation) -> duet_pb2.PrefillReply:
    return stub.Prefill(duet_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, reservation=res,
                                                sampling=SAMPLING), timeout=60)


def key_of(res: duet_pb2.Reservation) -> duet_pb2.ReservationKey:
    return duet_pb2.ReservationKey(reservation_id=res.reservation_id, generation=res.generation)


def test_a_reservation_nobody_renews_comes_back_within_its_lease_and_its_writer_refuses_it(ready, tokenizer):
    """Its holder reserves and goes silent, never giving it to the writer: the lease lapses,
    decode quarantines the pages and revokes the reservation at its writer, which holds no
    transfer for it, refuses it from now on and says so at once, so the pages come back long
    before the capability's 120 s (or the quarantine's end). A Generate comes too late
    (NOT_FOUND), renewing is refused, and a late Prefill writes nothing."""
    stack = ready
    prompt = tokenizer.encode("A reservation whose holder goes quiet right after reserving it.")
    before = lapses(stack, DECODE, "reservation")
    with stubs(stack) as (stub, pstub):
        res = reserve(stub, "unrenewed", prompt)
        reserved = time.monotonic()
        assert res.lease_ttl_ms == int(LEASE_S * 1000) and res.capability.lifetime_ms == 120_000
        # the gauge follows the engine loop's next iteration (tens of ms on a busy machine)
        wait_until(lambda: stack.kv_usage(DECODE) > 0, LEASE_S - 0.5, "the reservation's pages in the gauge",
                   interval=0.02)
        wait_until(lambda: lapses(stack, DECODE, "reservation") - before == 1, LEASE_S + 10, "the lease to lapse")
        assert time.monotonic() - reserved >= LEASE_S - 0.2  # not before its lease ran out
        stack.wait_idle([DECODE], timeout=QUARANTINE_S - 5)  # the writer's answer freed it, not the quarantine
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(duet_pb2.GenerateRequest(
                request_id="unrenewed", prompt_token_ids=prompt, reservation=res, prefill_worker_id=PREFILL,
                sampling=SAMPLING, first_token=duet_pb2.Token(id=1)),
                timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert list(stub.RenewLease(duet_pb2.RenewLeaseRequest(reservations=[key_of(res)]), timeout=10).lost) == \
            [key_of(res)]
        with pytest.raises(grpc.RpcError) as info:
            prefill(pstub, "unrenewed", prompt, res)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "revoked" in info.value.details()
    stack.wait_idle([DECODE, PREFILL], timeout=30)
    assert "stopped renewing its lease (RESERVED" in stack.procs[DECODE].log_text()


def test_a_written_reservation_nobody_claims_is_freed_when_its_lease_lapses(ready, tokenizer):
    """Prefill wrote it and sent its done notice; its holder never claims nor renews it: no
    write can land any more, so the lapse frees it at once (the claim timeout would be later)."""
    stack = ready
    prompt = tokenizer.encode("A reservation written by prefill that its holder then forgets.")
    before = lapses(stack, DECODE, "reservation")
    with stubs(stack) as (dstub, pstub):
        reply = prefill(pstub, "written-unrenewed", prompt, reserve(dstub, "written-unrenewed", prompt))
    assert reply.kv_bytes_sent > 0
    stack.wait_idle([DECODE, PREFILL], timeout=NOTICE_TIMEOUT_S + 10)
    assert lapses(stack, DECODE, "reservation") - before == 1
    log = stack.procs[DECODE].log_text()
    assert "stopped renewing its lease (WRITTEN" in log and "was never claimed" not in log


def test_a_renewing_holder_keeps_its_reservation_past_several_leases(ready, tokenizer):
    stack = ready
    prompt = tokenizer.encode("The capital of France is")
    ref = offline_outputs(offline_llm(model_dir()), [prompt], 4)[0]
    before = lapses(stack, DECODE, "reservation")
    with stubs(stack) as (dstub, pstub):
        res = reserve(dstub, "renewed", prompt)
        renew = duet_pb2.RenewLeaseRequest(reservations=[key_of(res)])
        end = time.monotonic() + 4 * LEASE_S
        while time.monotonic() < end:  # as the gateway does: every third of the lease
            assert list(dstub.RenewLease(renew, timeout=10).lost) == []
            time.sleep(LEASE_S / 3)
        reply = prefill(pstub, "renewed", prompt, res)
        assert list(dstub.RenewLease(renew, timeout=10).lost) == []
        tokens = [reply.first_token.id]
        for chunk in dstub.Generate(duet_pb2.GenerateRequest(
                request_id="renewed", prompt_token_ids=prompt, sampling=SAMPLING, reservation=res,
                prefill_worker_id=PREFILL, first_token=reply.first_token), timeout=60):
            tokens += [t.id for t in chunk.tokens]
    assert tokens == ref.token_ids
    assert lapses(stack, DECODE, "reservation") == before
    stack.wait_idle([DECODE, PREFILL], timeout=30)


def test_the_gateway_renews_its_reservation_while_prefill_is_slow(ready, model):
    """Prefill is held (SIGSTOP) for two leases, short of the registry TTL, while the gateway
    waits for its answer: the gateway's renewals keep the reservation, and the request, once
    prefill goes on, completes."""
    stack = ready
    before = lapses(stack, DECODE, "reservation")
    stack.procs[PREFILL].signal(signal.SIGSTOP)
    try:
        request = long_request(stack, model, prompt="A short prompt that prefill is too slow to answer at once:")
        holder(stack, [DECODE], "the decode reservation")
        time.sleep(2 * LEASE_S)
        assert lapses(stack, DECODE, "reservation") == before and stack.kv_usage(DECODE) > 0
    finally:
        stack.procs[PREFILL].signal(signal.SIGCONT)
    request.join(timeout=120)
    assert request.error is None and request.result
    assert lapses(stack, DECODE, "reservation") == before
    stack.wait_idle(timeout=30)


def test_a_stopped_gateway_strands_no_decode_pages(ready, model):
    """The gateway is SIGSTOPped while prefill computes the long prompt: it renews nothing, its
    reservation's lease lapses on decode, which quarantines the pages (prefill may still write)
    and revokes the reservation; prefill cancels the transfer (stops computing and writing) and
    its abort notice, once the writes in flight settled, frees decode's pages: all while the
    gateway is still stopped."""
    stack = ready
    before = lapses(stack, DECODE, "reservation")
    request = long_request(stack, model)
    holder(stack, [DECODE], "the decode reservation for the long prompt")
    try:
        with frozen_mid_prefill(stack, PREFILL, request):  # prefill has pages left to write when it goes on
            stack.procs["gateway"].signal(signal.SIGSTOP)
        wait_until(lambda: lapses(stack, DECODE, "reservation") - before == 1, LEASE_S + 5,
                   "the stopped gateway's lease to lapse", interval=0.05)
        stack.wait_idle([DECODE, PREFILL], timeout=QUARANTINE_S - 5)  # freed by the revoke, not the quarantine
        assert "stopped renewing its lease (RESERVED" in stack.procs[DECODE].log_text()
        assert "revoked the reservation" in stack.procs[PREFILL].log_text()
    finally:
        stack.procs["gateway"].signal(signal.SIGCONT)
    request.join(timeout=60)  # the request lost its reservation: a clean error (failover off)
    assert request.error is not None
    stack.wait_idle(timeout=30)


def test_a_transfer_to_a_stopped_decode_worker_is_cancelled_on_both_sides(ready, model):
    """Decode is SIGSTOPped while prefill writes into its reservation (prefill held first, so
    it has pages left to write): decode leaves the registry and takes no write, so the
    transfer's lease lapses on prefill, which stops computing and writing and frees its pages
    once the writes in flight settled. Decode, back, frees the reservation (prefill's abort
    notice, or its own lease and quarantine). Nothing leaks on either worker."""
    stack = ready
    before = lapses(stack, PREFILL, "transfer")
    request = long_request(stack, model)
    holder(stack, [DECODE], "the decode reservation for the long prompt")
    try:
        with frozen_mid_prefill(stack, PREFILL, request):
            stack.procs[DECODE].signal(signal.SIGSTOP)
            wait_until(lambda: DECODE not in stack.workers(), REGISTRY_TTL_S + 10, f"{DECODE} to leave the registry")
        wait_until(lambda: lapses(stack, PREFILL, "transfer") - before == 1, LEASE_S + 10,
                   "the transfer's lease to lapse on prefill")
        stack.wait_idle([PREFILL], timeout=WRITE_TIMEOUT_S + 10)  # the writes in flight settled: freed
        assert "the transfer's lease lapsed" in stack.procs[PREFILL].log_text()
    finally:
        stack.procs[DECODE].signal(signal.SIGCONT)
    request.join(timeout=60)
    assert request.error is not None  # the request lost its decode worker (failover off)
    stack.wait_registered([DECODE], timeout=30)
    stack.wait_idle(timeout=QUARANTINE_S + 10)
    r = stack.client().completions.create(model=model, prompt="After the partition, the sky is", max_tokens=4,
                                          temperature=0)
    assert r.usage.completion_tokens >= 1
    stack.wait_idle(timeout=30)
