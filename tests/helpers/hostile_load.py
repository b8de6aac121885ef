"""Helpers for the hostile-load tests (abort storm, overload): the stack's load counters in
one snapshot, streams dropped after their first chunk, and a steady client.

A snapshot holds what must return to its starting value once the load ends: every
worker's KV usage, running requests (decode counts its open reservations there) and
waiting requests; the router's in-flight requests; the gateway's admitted and queued
requests; and the registry's worker entries (id -> instance nonce), so an entry lost or
registered twice shows up."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadSnapshot:
    workers: dict[str, tuple[float, float, float]]  # id -> (kv usage, running, waiting)
    router_inflight: float
    gateway_admitted: float
    gateway_queued: float
    registry: dict[str, str]  # worker id -> instance nonce
    registry_keys: int         # duet:worker:<id> hashes (no side keys)

    @property
    def idle(self) -> bool:
        return (all(v == (0, 0, 0) for v in self.workers.values()) and self.router_inflight == 0
                and self.gateway_admitted == 0 and self.gateway_queued == 0)


def snapshot(stack) -> LoadSnapshot:
    entries = stack.workers()
    workers = {}
    for wid in sorted(entries):
        m = stack.metrics(wid)
        workers[wid] = (m.value("duet_kv_cache_usage_ratio"), m.value("duet_running_requests"),
                        m.value("duet_waiting_requests"))
    gateway = stack.gateway_metrics()
    keys = sum(1 for k in stack.redis().scan_iter("duet:worker:*") if ":" not in k[len("duet:worker:"):])
    return LoadSnapshot(workers, stack.router_metrics().value("duet_router_inflight_requests"),
                        gateway.value("duet_gateway_admitted_requests"), gateway.value("duet_gateway_queued_requests"),
                        {w: f.get("instance_nonce", "") for w, f in entries.items()}, keys)


def wait_idle_again(stack, before: LoadSnapshot, timeout: float) -> tuple[LoadSnapshot, float]:
    """Poll until every counter is back where it started; (last snapshot, seconds taken)."""
    started = time.monotonic()
    while True:
        now = snapshot(stack)
        if now.idle and now.registry == before.registry and now.registry_keys == before.registry_keys:
            return now, time.monotonic() - started
        if time.monotonic() - started > timeout:
            return now, time.monotonic() - started
        time.sleep(0.25)


@dataclass
class StormResult:
    statuses: Counter = field(default_factory=Counter)  # HTTP status, or "first chunk" / an exception name
    first_chunks: int = 0
    opened_in_s: float = 0.0


async def drop_after_first_chunk(http: httpx.AsyncClient, model: str, i: int, result: StormResult) -> None:
    chat = i % 2 == 0
    body = {"model": model, "max_tokens": 16, "stream": True, "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Storm request {i}: tell me a long story."}]
    else:
        body["prompt"] = f"Storm request {i}: once upon a time"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with http.stream("POST", path, json=body) as response:
            result.statuses[response.status_code] += 1
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    result.first_chunks += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        result.statuses[type(exc).__name__] += 1


async def storm(base_url: str, model: str, count: int, spread_s: float) -> StormResult:
    """`count` streams opened evenly over `spread_s` seconds, each dropped after its first chunk."""
    result = StormResult()
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        started = time.monotonic()
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(drop_after_first_chunk(http, model, i, result)))
            await asyncio.sleep(spread_s / count)
        result.opened_in_s = time.monotonic() - started
        await asyncio.gather(*tasks)
    return result


@dataclass
class SteadyResult:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


async def steady_client(base_url: str, model: str, expected: str, stop: asyncio.Event,
                        interval_s: float = 0.25) -> SteadyResult:
    """One request at a time until `stop`; each must be 200 with the expected greedy text."""
    result = SteadyResult()
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                r = await http.post("/v1/completions", json=steady_body(model))
                if r.status_code != 200:
                    result.errors.append(f"{r.status_code}: {r.text[:200]}")
                elif r.json()["choices"][0]["text"] != expected:
                    result.errors.append(f"text {r.json()['choices'][0]['text']!r} != {expected!r}")
                else:
                    result.ok += 1
                    result.latencies.append(time.monotonic() - started)
            except httpx.HTTPError as exc:
                result.errors.append(repr(exc))
            await asyncio.sleep(interval_s)
    return result


def steady_body(model: str) -> dict:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
