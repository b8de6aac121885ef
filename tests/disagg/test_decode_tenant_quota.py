"""Decode's Reserve queue and the live-page quota, on real decode worker processes over gRPC.

Tenant B holds a reservation of over half the pool and waits for a second one that does not
fit; tenant A then asks for one that fits. Both workers run `--reserve-aging 0`: a call that
does not fit holds up every call after it at once (a small one no longer passes it). With
`--kv-tenant-max-share 0.5` B's waiting call is passed over all the same and A's goes ahead
of it at once (the worker counts it in `duet_kv_tenant_passed_over_total{stage="reserve"}`);
with 1.0 (off) A waits behind B until its deadline (429's RESOURCE_EXHAUSTED). B's waiting
call is served once B's first reservation is cancelled, and every page comes back."""
from __future__ import annotations

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.stack import ProcessStack, managed, new_log_dir, wait_until

TENANT_A, TENANT_B = 0xA, 0xB
WORKERS = {"decode-quota": "0.5", "decode-fifo": "1.0"}


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("decode-tenant-quota"), kv_cache_memory="64M")
    with managed(request, s):
        s.start_redis()
        for worker, share in WORKERS.items():
            s.add_worker("decode", worker, extra=["--kv-tenant-max-share", share, "--reserve-aging", "0"])
        s.wait_registered(list(WORKERS))
        yield s


def reserve(stub, rid: str, tokens: int, tenant: int, timeout_ms: int = 20_000):
    return stub.Reserve.future(duet_pb2.ReserveRequest(
        request_id=rid, prompt_tokens=tokens, max_tokens=1, prefill_worker_id="no-writer", timeout_ms=timeout_ms,
        tenant=tenant, cache_namespace=tenant), timeout=60)


def cancel(stub, res) -> None:
    stub.Cancel(duet_pb2.CancelRequest(reservation_id=res.reservation_id, generation=res.generation,
                                       prefill_not_sent=True), timeout=30)


@pytest.mark.parametrize("worker", list(WORKERS))
def test_a_tenant_over_its_live_share_lets_another_tenant_reserve_first(stack, worker):
    entry = stack.workers()[worker]
    tokens = int(entry["load_total_pages"]) * int(entry["page_size"])
    with grpc.insecure_channel(entry["address"]) as channel:
        stub = duet_pb2_grpc.DecodeStub(channel)
        first_b = reserve(stub, f"{worker}-b1", tokens * 55 // 100, TENANT_B).result()
        waiting_b = reserve(stub, f"{worker}-b2", tokens * 50 // 100, TENANT_B)  # does not fit: waits
        quota = WORKERS[worker] != "1.0"
        a = reserve(stub, f"{worker}-a", tokens * 30 // 100, TENANT_A, timeout_ms=3000)
        if quota:
            res_a = a.result()  # B holds its share: A goes first, though B asked first
            assert not waiting_b.done() and res_a.page_size > 0
            # the counter is exported by the worker's load loop: wait for its next beat
            wait_until(lambda: stack.metrics(worker).value("duet_kv_tenant_passed_over_total", stage="reserve") == 1,
                       10, "the passed-over counter")
        else:
            with pytest.raises(grpc.RpcError) as info:
                a.result()  # B's aged call holds up A's, past A's deadline
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert stack.metrics(worker).value("duet_kv_tenant_passed_over_total", stage="reserve") == 0
        cancel(stub, first_b)
        if quota:
            cancel(stub, res_a)
        second_b = waiting_b.result()  # room again: B's waiting call is served
        cancel(stub, second_b)
    stack.wait_idle([worker])
