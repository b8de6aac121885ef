"""The router's own account of requests it routed and that are not released yet.

Workers report their load only once per heartbeat; between beats a burst would all
go to the same "least loaded" worker. So the router adds what it has just sent.
Entries leave on Release (PREFILL_DONE drops the prefill share, DONE everything), when
their worker leaves the registry, or after a TTL (`--inflight-ttl`): a gateway that died
never releases, and a Route nobody follows up (a client of the router's gRPC that only
routes) must not pin load. The account only bridges the heartbeats: a request that really
runs is in its worker's reported load long before its entry expires, and loads are the
larger of the two, so a short TTL forgets nothing that is real.

The other way round, a heartbeat may still count a request that ended since: the report
the router holds was written at most a heartbeat plus a registry scan ago, so the tracker
keeps each worker's DONE releases of that window (`released_since_report`), and a
conversation's next turn does not see its own previous turn still running there.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
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
    released_since_report: int = 0  # requests ended here that its load report may still count


class InflightTracker:
    def __init__(self, ttl_s: float, report_age_s: float = 2.0):
        """report_age_s: how old a worker's load report can be (heartbeat + registry scan)."""
        self.ttl_s = ttl_s
        self.report_age_s = report_age_s
        self._requests: dict[str, RoutedRequest] = {}
        self._released: deque[tuple[float, str]] = deque()  # (time.monotonic(), decode worker) of DONE releases

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
            self._released.append((time.monotonic(), req.decode_worker))
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

    def per_worker(self, now: float | None = None) -> dict[str, WorkerInflight]:
        now = time.monotonic() if now is None else now
        while self._released and self._released[0][0] < now - self.report_age_s:
            self._released.popleft()
        loads: dict[str, WorkerInflight] = defaultdict(WorkerInflight)
        for req in self._requests.values():
            if req.prefill_worker is not None:
                load = loads[req.prefill_worker]
                load.prefill_tokens += req.prefill_tokens
                load.prefill_requests += 1
            load = loads[req.decode_worker]
            load.decode_pages += req.decode_pages
            load.decode_requests += 1
        for _, worker_id in self._released:
            loads[worker_id].released_since_report += 1
        return dict(loads)
