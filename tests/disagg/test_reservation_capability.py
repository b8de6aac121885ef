"""Write capabilities and decode's Reserve queue through real processes: redis, router,
gateway, a prefill and decode workers over gRPC and NIXL, driven over the workers' own gRPC
API as a client that calls them directly would (shared/kv_transfer/capability.py,
services/decode/reserve_queue.py).

* A Prefill call whose reservation carries no capability, a forged one, one for another
  writer, one whose pages were changed, or one already used is refused (PERMISSION_DENIED,
  the reason said and counted) before anything is computed or written: a greedy answer that
  reads the decode worker's cached pages is the same after as before, and the reservation
  the forgeries named is still the rightful writer's.
* A reservation nobody claims is quarantined at the end of its capability's lifetime and
  freed once no write can land, though its caller asked for a ten-minute wait; a Reserve's
  own wait is capped by the worker's --reserve-timeout whatever its timeout_ms says.
* A 1-page Reserve is granted past a 500-page one that waits for room; once the big one
  has waited --reserve-aging, smaller ones stop passing it, and it is granted as soon as
  room exists. Waiting Reserves take turns by request group: another client's one is
  granted with the next pages freed, not after the ones a prompt list queued before it."""
from __future__ import annotations

import concurrent.futures
import os
import time

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.stack import ProcessStack, managed, new_log_dir, wait_until

pytestmark = pytest.mark.slow

PAGE = 16
A = "The capital of France is"
SAMPLING = duet_pb2.SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("capability"), kv_cache_memory="64M")
    with managed(request, s.start(prefill=1, decode=1)) as s:
        s.wait_ready()
        yield s


def reserve(stub, request_id: str, prompt_tokens: int, writer: str = "prefill-0", **fields) -> duet_pb2.Reservation:
    return stub.Reserve(duet_pb2.ReserveRequest(request_id=request_id, prompt_tokens=prompt_tokens, max_tokens=1,
                                                prefill_worker_id=writer, **fields), timeout=60)


def refused(stub, reservation: duet_pb2.Reservation, prompt: list[int]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(duet_pb2.PrefillRequest(request_id="attack", prompt_token_ids=prompt, sampling=SAMPLING,
                                             reservation=reservation), timeout=60)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    return info.value.details()


def test_a_prefill_call_without_a_valid_capability_writes_nothing(stack):
    client = stack.client()
    ask = dict(model=client.models.list().data[0].id, prompt=A, max_tokens=8, temperature=0)
    before_answer = client.completions.create(**ask).choices[0].text
    entries = stack.workers()
    pages = int(entries["decode-0"]["load_total_pages"])
    every_page = list(range(1, pages))  # the attack names every page decode has, A's cached ones too
    junk = [7] * (len(every_page) * PAGE)  # a prompt that would fill them all
    sent_before = stack.metrics("prefill-0").value("duet_kv_transfer_bytes_total", direction="sent")
    with grpc.insecure_channel(entries["decode-0"]["address"]) as dch, \
            grpc.insecure_channel(entries["prefill-0"]["address"]) as pch:
        decode, prefill = duet_pb2_grpc.DecodeStub(dch), duet_pb2_grpc.PrefillStub(pch)
        good = reserve(decode, "rightful", PAGE)
        assert good.capability.writer_id == "prefill-0" and len(good.capability.secret) == 16
        other_writer = reserve(decode, "someone-else", PAGE, writer="prefill-9")

        missing = duet_pb2.Reservation()
        missing.CopyFrom(good)
        missing.ClearField("capability")
        forged = duet_pb2.Reservation()
        forged.CopyFrom(good)
        forged.capability.signature = os.urandom(64)
        moved = duet_pb2.Reservation()
        moved.CopyFrom(good)
        for reservation in (missing, forged, moved):
            del reservation.ranks[0].page_ids[:]
            reservation.ranks[0].page_ids.extend(every_page)
        assert "carries no write capability" in refused(prefill, missing, junk)
        assert "does not verify" in refused(prefill, forged, junk)
        assert "does not verify" in refused(prefill, moved, junk)  # a real signature, other pages
        assert "is for writer 'prefill-9'" in refused(prefill, other_writer, [7] * PAGE)

        # the forgeries named the rightful reservation: it is still its writer's, once
        prompt = list(range(100, 100 + PAGE))
        reply = prefill.Prefill(duet_pb2.PrefillRequest(request_id="rightful", prompt_token_ids=prompt,
                                                        sampling=SAMPLING, reservation=good), timeout=60)
        assert reply.kv_bytes_sent > 0
        assert "used already" in refused(prefill, good, prompt)
        for res in (good, other_writer):
            decode.Cancel(duet_pb2.CancelRequest(reservation_id=res.reservation_id, generation=res.generation),
                          timeout=10)
    metrics = stack.metrics("prefill-0")
    assert metrics.value("duet_kv_transfer_bytes_total", direction="sent") - sent_before == reply.kv_bytes_sent
    assert {r: metrics.value("duet_kv_writes_refused_total", reason=r)
            for r in ("missing", "signature", "writer", "reused")} == \
        {"missing": 1, "signature": 2, "writer": 1, "reused": 1}
    assert stack.metrics("decode-0").value("duet_kv_notices_refused_total", reason="forged") == 0
    assert client.completions.create(**ask).choices[0].text == before_answer  # decode's pages untouched
    stack.wait_idle(timeout=60)


def test_an_unclaimed_reservation_is_freed_by_its_deadline_whatever_the_caller_asked(stack):
    # lifetime 4 s (a scrape right after the reply must still see the pages on a loaded machine);
    # quarantine max(2 x write timeout, notice timeout) = 2 s; waits of at most 2 s
    stack.add_worker("decode", "decode-ttl", extra=["--reservation-ttl", "4", "--write-timeout", "1",
                                                    "--notice-timeout", "1", "--reserve-timeout", "2"])
    stack.wait_registered(["decode-ttl"])
    entry = stack.workers()["decode-ttl"]
    pages = int(entry["load_total_pages"])
    with grpc.insecure_channel(entry["address"]) as channel:
        stub = duet_pb2_grpc.DecodeStub(channel)
        res = reserve(stub, "nobody-claims", 4 * PAGE, timeout_ms=600_000)
        assert res.capability.lifetime_ms == 4000
        # the gauge follows the engine loop's next publish, a moment after the reply on a loaded machine
        wait_until(lambda: stack.kv_usage("decode-ttl") > 0, 3, "the reserved pages in decode-ttl's KV gauge",
                   interval=0.05)
        stack.wait_idle(["decode-ttl"], timeout=30)
        # a wait the worker caps: the pages held by one reservation leave no room for a second
        big = reserve(stub, "most-pages", (pages - 8) * PAGE, timeout_ms=600_000)
        with pytest.raises(grpc.RpcError) as info:
            reserve(stub, "no-room", (pages // 2) * PAGE, timeout_ms=600_000)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no room after 2.0s" in info.value.details()
        stub.Cancel(duet_pb2.CancelRequest(reservation_id=big.reservation_id, generation=big.generation,
                                           prefill_not_sent=True), timeout=10)
    log = stack.procs["decode-ttl"].log_text()
    assert "write capability expired unclaimed" in log
    stack.wait_idle(["decode-ttl"], timeout=30)
    stack.kill("decode-ttl", 15)


AGING_S = 3.0


@pytest.fixture(scope="module")
def decode_q(stack):
    """A decode worker with room for a 500-page reservation and a short aging time."""
    stack.add_worker("decode", "decode-q", extra=["--kv-cache-memory", "400M", "--reserve-aging", str(AGING_S),
                                                  "--reserve-timeout", "60"])
    stack.wait_registered(["decode-q"])
    return stack.workers()["decode-q"]


def cancel(stub, res) -> None:
    stub.Cancel(duet_pb2.CancelRequest(reservation_id=res.reservation_id, generation=res.generation,
                                       prefill_not_sent=True), timeout=10)


def test_a_small_reserve_passes_a_waiting_big_one_until_the_big_one_has_aged(stack, decode_q):
    aging_s = AGING_S
    entry = decode_q
    pages = int(entry["load_total_pages"])
    assert 520 < pages < 600, pages  # 500 pages fit the pool, and a prompt of them the context
    with grpc.insecure_channel(entry["address"]) as channel, concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = duet_pb2_grpc.DecodeStub(channel)
        holder = reserve(stub, "holder", (pages - 100) * PAGE)  # ~100 pages stay free
        big = pool.submit(reserve, stub, "big", 500 * PAGE)
        time.sleep(0.5)
        assert not big.done()  # waiting for room
        small = reserve(stub, "small", PAGE)  # fits: granted past the big one
        assert len(small.ranks[0].page_ids) == 1 and not big.done()
        cancel(stub, small)
        time.sleep(aging_s + 0.5)  # the big one has aged
        with pytest.raises(grpc.RpcError) as info:  # it fits the free pages, but may not pass now
            reserve(stub, "small-after", PAGE, timeout_ms=1500)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not big.done()
        cancel(stub, holder)  # room: the big one goes
        granted = big.result(timeout=60)
        assert len(granted.ranks[0].page_ids) == 500
        cancel(stub, granted)
    stack.wait_idle(["decode-q"], timeout=30)


def test_a_prompt_list_leaves_another_client_room_in_the_pool(stack, decode_q):
    """One request group's Reserves may not take the pool's last sixteenth while the group
    holds more than its share: its eleventh 50-page Reserve waits though 68 pages are free,
    and another client's 40-page one is granted at once."""
    pages = int(decode_q["load_total_pages"])
    with grpc.insecure_channel(decode_q["address"]) as channel, concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = duet_pb2_grpc.DecodeStub(channel)
        listed = [reserve(stub, f"big-list-{i}", 50 * PAGE, request_group="big-list") for i in range(10)]
        free = pages - 500
        assert 51 <= free and free - 51 < pages // 16  # the eleventh fits, but into the last sixteenth
        eleventh = pool.submit(reserve, stub, "big-list-10", 50 * PAGE, request_group="big-list")
        time.sleep(0.5)
        assert not eleventh.done()
        other = reserve(stub, "another-client", 40 * PAGE, request_group="another-client")
        assert len(other.ranks[0].page_ids) == 40 and not eleventh.done()
        for res in listed + [other]:
            cancel(stub, res)
        cancel(stub, eleventh.result(timeout=30))
    stack.wait_idle(["decode-q"], timeout=30)


def test_waiting_reserves_take_turns_by_request_group(stack):
    """A decode worker's three batch places are taken; six Reserves of one prompt list wait,
    then one of another request. Each reservation cancelled frees one place: the list's first
    gets the first, the other request the second (not the seventh)."""
    stack.add_worker("decode", "decode-rr", extra=["--max-running-requests", "3", "--reserve-timeout", "60"])
    stack.wait_registered(["decode-rr"])
    entry = stack.workers()["decode-rr"]
    with grpc.insecure_channel(entry["address"]) as channel, concurrent.futures.ThreadPoolExecutor(8) as pool:
        stub = duet_pb2_grpc.DecodeStub(channel)
        holders = [reserve(stub, f"hold-{i}", PAGE) for i in range(3)]
        waits = {}
        for i in range(6):
            waits[f"list-{i}"] = pool.submit(reserve, stub, f"list-{i}", PAGE, request_group="the-list")
            time.sleep(0.1)  # arrival order
        waits["other"] = pool.submit(reserve, stub, "other", PAGE, request_group="another-client")
        time.sleep(0.5)
        assert not any(w.done() for w in waits.values())

        def granted() -> set[str]:
            return {name for name, w in waits.items() if w.done()}
        cancel(stub, holders[0])
        waits["list-0"].result(timeout=30)
        time.sleep(0.3)
        assert granted() == {"list-0"}
        cancel(stub, holders[1])
        waits["other"].result(timeout=30)
        time.sleep(0.3)
        assert granted() == {"list-0", "other"}
        cancel(stub, holders[2])
        for w in waits.values():  # each one cancelled lets the next in
            cancel(stub, w.result(timeout=30))
    stack.wait_idle(["decode-rr"], timeout=30)
