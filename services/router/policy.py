"""How the router picks workers (pure functions; the service feeds them).

Prefill: cost = queue_weight * queued_tokens + (prompt_tokens - cached_tokens), i.e. the
prefill work ahead of this request's first token. A worker holding the prompt's prefix
is cheaper by the cached tokens, but once its queue is longer than that saving the
next worker wins, so one hot system prompt does not pin all traffic (Dynamo's KV router
and SGLang's cache-aware router weigh the same two terms).
queued_tokens = max(reported by heartbeat, routed here and not released): the report
covers other router replicas, the local count covers the burst since the last beat,
and taking the max avoids counting a request twice.

Decode: cost = KV usage after placing the request + batch_weight * batch occupancy
+ transfer_weight * the share of the prompt it does NOT hold (its KV events say which
leading pages it holds in any tier; only the rest is written to it; the share is taken of at
least `decode_transfer_min_tokens`, so for short prompts load decides), preferring workers
whose free pages fit the request (decode's Reserve still does the real admission). So a
conversation's turns stay with the decode worker that holds them unless its load outweighs
the saving. Same max(reported, local) rule for pages and running requests.

A pair is chosen decode first (its cache saves the transfer, and with local prefill the
prefill too), then the prefill worker among those that can write into it.

Local prefill (conditional disaggregation): when the chosen decode worker holds at least
`local_prefill_min_share` of the prompt and the rest is at most `local_prefill_max_tokens`,
it prefills the rest itself: no prefill worker, no transfer.

LoRA: only workers serving the request's adapter are candidates (the service filters); one that
must first load it into a device slot counts `lora_load_tokens` more prompt tokens to compute
(prefill) or not held (decode), so requests of an adapter go where it sits already unless load
says otherwise.

Ties go to the worker with fewer requests routed here, then rotate, so equal workers
share a burst evenly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.config import RoutingWeights
from services.router.inflight import WorkerInflight
from shared.admission.kv_demand import kv_demand
from shared.registry.worker_info import WorkerInfo

_NO_LOAD = WorkerInflight()


@dataclass(frozen=True)
class PrefillChoice:
    worker: WorkerInfo
    cached_tokens: int
    uncached_tokens: int
    cost: float


@dataclass(frozen=True)
class DecodeChoice:
    worker: WorkerInfo
    pages: int
    cost: float
    cached_tokens: int = 0  # leading prompt tokens the worker holds (from its KV events)


def cached_tokens_for(cached_pages: int, page_size: int, prompt_tokens: int) -> int:
    """Prompt tokens a worker can skip; the last prompt token is always computed (it yields the logits)."""
    return max(0, min(cached_pages * page_size, prompt_tokens - 1))


def pages_needed(prompt_tokens: int, max_tokens: int, page_size: int, n: int = 1) -> int:
    """The request's KV pages on a worker of this page size (shared.admission.kv_demand)."""
    if page_size <= 0:
        return 0
    return kv_demand(max(0, prompt_tokens), max(0, max_tokens), max(1, n), page_size).pages


def lora_load_tokens(worker: WorkerInfo, adapter: str, weights: RoutingWeights) -> int:
    """What loading the request's LoRA adapter on `worker` counts as, in prompt tokens (0: none
    needed, or it holds the adapter in a device slot)."""
    return 0 if not adapter or adapter in worker.adapters.resident else weights.lora_load_tokens


def _rotate(items: Sequence, offset: int) -> list:
    if not items:
        return []
    k = offset % len(items)
    return list(items[k:]) + list(items[:k])


def choose_prefill(
    workers: Sequence[WorkerInfo],
    *,
    prompt_tokens: int,
    cached_pages: dict[str, int],
    inflight: dict[str, WorkerInflight],
    weights: RoutingWeights,
    rotation: int = 0,
    adapter: str = "",
) -> PrefillChoice | None:
    best: PrefillChoice | None = None
    best_key = None
    for worker in _rotate(workers, rotation):
        local = inflight.get(worker.worker_id, _NO_LOAD)
        queued = max(worker.load.queued_prefill_tokens, local.prefill_tokens)
        cached = cached_tokens_for(cached_pages.get(worker.worker_id, 0), worker.page_size, prompt_tokens)
        uncached = prompt_tokens - cached
        cost = weights.prefill_queue_weight * queued + uncached + lora_load_tokens(worker, adapter, weights)
        key = (cost, local.prefill_requests)
        if best_key is None or key < best_key:
            best, best_key = PrefillChoice(worker, cached, uncached, cost), key
    return best


def choose_decode(
    workers: Sequence[WorkerInfo],
    *,
    prompt_tokens: int,
    max_tokens: int,
    inflight: dict[str, WorkerInflight],
    weights: RoutingWeights,
    rotation: int = 0,
    cached_pages: dict[str, int] | None = None,
    n: int = 1,
    adapter: str = "",
) -> DecodeChoice | None:
    best: DecodeChoice | None = None
    best_key = None
    cached_pages = cached_pages or {}
    for worker in _rotate(workers, rotation):
        local = inflight.get(worker.worker_id, _NO_LOAD)
        held = cached_pages.get(worker.worker_id, 0)
        cached = cached_tokens_for(held, worker.page_size, prompt_tokens)
        # pages it holds stay shared with its cache: only the rest is new
        need = max(0, pages_needed(prompt_tokens, max_tokens, worker.page_size, n) - held)
        total = worker.load.total_pages
        used = max(total - worker.load.free_pages, local.decode_pages) if total > 0 else 0
        fits = total <= 0 or total - used >= need
        usage_after = (used + need) / total if total > 0 else 0.0
        running = max(worker.load.running_requests + worker.load.waiting_requests, local.decode_requests)
        batch_cap = worker.max_running_requests or weights.nominal_decode_batch
        # a short prompt's transfer costs next to nothing: count it against a floor
        missing = (prompt_tokens - cached + lora_load_tokens(worker, adapter, weights)) / max(
            prompt_tokens, weights.decode_transfer_min_tokens, 1)
        cost = (usage_after + weights.decode_batch_weight * running / batch_cap
                + weights.decode_transfer_weight * missing)
        key = (not fits, cost, local.decode_requests)
        if best_key is None or key < best_key:
            best, best_key = DecodeChoice(worker, need, cost, cached), key
    return best


def local_prefill_reason(decode: DecodeChoice, prompt_tokens: int, weights: RoutingWeights) -> str:
    """Why the decode worker should prefill the rest itself, or "" when it should not."""
    rest = prompt_tokens - decode.cached_tokens
    if weights.local_prefill_max_tokens <= 0 or prompt_tokens <= 0:
        return ""
    share = decode.cached_tokens / prompt_tokens
    if share < weights.local_prefill_min_share or rest > weights.local_prefill_max_tokens:
        return ""
    return (f"local prefill: decode {decode.worker.worker_id} holds {decode.cached_tokens} of "
            f"{prompt_tokens} prompt tokens ({share:.0%}); {rest} left to compute")


def choose_colocated(
    workers: Sequence[WorkerInfo],
    *,
    prompt_tokens: int,
    max_tokens: int,
    cached_pages: dict[str, int],
    inflight: dict[str, WorkerInflight],
    weights: RoutingWeights,
    rotation: int = 0,
    n: int = 1,
    adapter: str = "",
) -> tuple[PrefillChoice, DecodeChoice] | None:
    """A `both` worker runs prefill and decode: order by prefill cost (prefix cache, queue),
    then by decode cost."""
    best, best_key = None, None
    for worker in _rotate(workers, rotation):
        prefill = choose_prefill([worker], prompt_tokens=prompt_tokens, cached_pages=cached_pages,
                                 inflight=inflight, weights=weights, adapter=adapter)
        decode = choose_decode([worker], prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                               inflight=inflight, weights=weights, n=n, adapter=adapter)
        key = (prefill.cost, decode.cost)
        if best_key is None or key < best_key:
            best, best_key = (prefill, decode), key
    return best
