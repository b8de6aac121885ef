"""What the live workers can hold, as the gateway sees it (registry entries, or the in-process
engine), and the "can never fit" rule applied to it before anything is sent.

A request fits when some `both` worker holds its KV demand (shared.admission.kv_demand), or
some decode worker holds it and some prefill worker holds the prompt. What fits no live worker
is a 400 at once, in either mode; with no worker known yet the workers judge (the same rule)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.admission.kv_demand import KV_CAPACITY_EXCEEDED, check_fits, kv_demand
from shared.openai_protocol.errors import InvalidRequest

SERVING_ROLES = ("decode", "both")  # the roles that hold a request's sequences to the end


@dataclass(frozen=True)
class WorkerCapacity:
    role: str          # prefill | decode | both
    kv_pages: int      # its whole KV pool, free or not
    page_size: int
    max_running: int   # its batch cap (0 = unknown)
    max_batched_tokens: int = 0  # prompt tokens one of its steps takes (0 = unknown)


PREFILL_STEPS_AHEAD = 2  # prompt tokens in flight: this many steps of each prefilling worker


def batch_capacity(workers: Sequence[WorkerCapacity]) -> int:
    """Sequences the serving workers run at once, summed (0: unknown)."""
    caps = [w.max_running for w in workers if w.role in SERVING_ROLES]
    return sum(caps) if caps and all(caps) else 0


def prefill_capacity(workers: Sequence[WorkerCapacity]) -> int:
    """Prompt tokens worth sending ahead of the workers that prefill (prefill and both
    roles): a few of their steps, so a newcomer's prompt waits at most that long there (0: unknown)."""
    steps = [w.max_batched_tokens for w in workers if w.role in ("prefill", "both")]
    return PREFILL_STEPS_AHEAD * sum(steps) if steps and all(steps) else 0


def check_fits_some_worker(workers: Sequence[WorkerCapacity], prompt_tokens: int, max_tokens: int, n: int,
                           param: str = "max_tokens") -> None:
    """InvalidRequest (kv_capacity_exceeded) when no live worker can ever hold the request."""
    known = [w for w in workers if w.kv_pages > 0 and w.page_size > 0]
    serving = [w for w in known if w.role in SERVING_ROLES]
    if not serving:
        return  # nothing known: the workers check it themselves
    prefills = [w for w in known if w.role == "prefill"]
    fitting = [w for w in serving if kv_demand(prompt_tokens, max_tokens, n, w.page_size).pages <= w.kv_pages]
    if any(w.role == "both" for w in fitting):
        return
    if fitting and (not prefills or any(kv_demand(prompt_tokens, 1, 1, w.page_size).pages <= w.kv_pages
                                        for w in prefills)):
        return
    if fitting:
        raise InvalidRequest(f"the prompt ({prompt_tokens} tokens) does not fit the KV pool of any prefill worker",
                             "prompt", KV_CAPACITY_EXCEEDED)
    largest = max(serving, key=lambda w: w.kv_pages * w.page_size)
    try:
        check_fits(kv_demand(prompt_tokens, max_tokens, n, largest.page_size), largest.kv_pages,
                   f"the largest {largest.role} worker")
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param, exc.code) from None
