"""The router's own account of requests it routed and that are not released yet.

Workers report their load only once per heartbeat; between beats a burst would all
go to the same "least loaded" worker. So the router adds what it has just sent.
Entries leave on Release (PREFILL_DONE drops the prefill share, DONE everything), when
their worker leaves the registry, or after a TTL (`--inflight-ttl`): a gateway that died
never releases, and a Route nobody follows up (a client of the router's gRPC that only
routes) must not pin load. The account only bridges the heartbeats: a request that really
runs is in its worker's reported load long before its entry expires, and loads are the
larger of the two, so a short TTL forgets nothing that is real.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class RoutedRequest:
    request_id: str
    prefill_worker: str | None     # None when colocated
    prefill_tokens: int            # uncached prompt tokens sent to prefill_worker
    decode_worker: str             # decode worker or the colocated `both` worker
    decode_pages: int              # KV pages the request will hold on decode
    created: float                 # time.monotonic()


@dataclass
class WorkerInflight:
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_pages: int = 0
    decode_requests: int = 0


class InflightTracker:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._requests: dict[str, RoutedRequest] = {}

    def __len__(self) -> int:
        """Entries not yet past the TTL (expire() drops them at the next Route)."""
        now = time.monotonic()
        return sum(1 for req in self._requests.values() if now - req.created <= self.ttl_s)

    def add(self, req: RoutedRequest) -> None:
        self._requests[req.request_id] = req

    def release(self, request_id: str, prefill_only: bool) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        if prefill_only:
            req.prefill_worker, req.prefill_tokens = None, 0
        else:
            del self._requests[request_id]
        return True

    def expire(self, live_workers: set[str], now: float | None = None) -> int:
        """Drop entries past the TTL or whose decode worker left; clear prefill shares of gone prefills."""
        now = time.monotonic() if now is None else now
        dropped = 0
        for rid, req in list(self._requests.items()):
            if now - req.created > self.ttl_s or req.decode_worker not in live_workers:
                del self._requests[rid]
                dropped += 1
            elif req.prefill_worker is not None and req.prefill_worker not in live_workers:
                req.prefill_worker, req.prefill_tokens = None, 0
        return dropped

    def per_worker(self) -> dict[str, WorkerInflight]:
        loads: dict[str, WorkerInflight] = defaultdict(WorkerInflight)
        for req in self._requests.values():
            if req.prefill_worker is not None:
                load = loads[req.prefill_worker]
                load.prefill_tokens += req.prefill_tokens
                load.prefill_requests += 1
            load = loads[req.decode_worker]
            load.decode_pages += req.decode_pages
            load.decode_requests += 1
        return dict(loads)
