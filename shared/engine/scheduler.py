"""Continuous batching with chunked prefill under a per-step token budget.

Each step takes every decoding request (one token each), then fills what is left of the
token budget with prefill chunks: admitted requests first, then waiting ones, taken round
robin across request groups (the client request a prompt came from: a prompt list's prompts
are one group), oldest first within a group, so a one-prompt request beside a bulk one is
admitted within about a step instead of after the bulk's queue. Admission needs free pages;
when they run out, new work waits in the queue (back-pressure) and, if decoding requests
cannot grow, the youngest running request is retracted (its pages freed, recomputed later,
ahead of every group). In that order, a waiting request whose tenant's live work already
holds its share of the pages lets other tenants' waiting requests be admitted first
(tenant_quota.py).

Beside decode rows, an optional `itl_budget` (shared/perf_model/step_budget.py) narrows the
prefill chunks further, so the step stays under an inter-token latency target, unless the
prefill queued here (prefill_queue below) needs wider chunks to meet its first-token target.

A request whose prefix is still being loaded back from the host tier (its load's ticket not
yet seen landed, kv_host_tier.py) is admitted but left out of the steps until the load
lands: the other requests' steps never wait for the copy."""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator

from shared.perf_model.ttft_pressure import QueuedPrefill

from .batch import Batch, ScheduledReq
from .kv_manager import KVManager
from .request import Req, ReqStatus

# the queue the step budget weighs: its first requests, read every step (a few microseconds each);
# a queue of long prompts asks for the whole token budget within a few, and one of many short
# ones is weighed by its head
MAX_WEIGHED_QUEUE = 256


class Scheduler:
    def __init__(self, kv: KVManager, max_batched_tokens: int, max_running: int, lora=None):
        """lora: the engine's LoraManager (shared/engine/lora/manager.py), None without adapters. A
        request of an adapter is admitted only with a device slot holding it, as only with pages."""
        self.kv = kv
        self.lora = lora
        self.failed: list[tuple[Req, str]] = []  # taken out of the queue: their adapter could not load
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.waiting: deque[Req] = deque()  # every waiting request, arrival order (retracted ones in front)
        self.running: list[Req] = []  # admitted, in arrival order
        self.num_retracted = 0
        self._groups: dict[str, deque[Req]] = {}  # the waiting requests of each request group, in order
        self._retracted: set[str] = set()  # waiting rids put back at the front: admitted before any group
        self._served: dict[str, int] = {}  # group -> when it was last admitted from (round robin)
        self._turns = itertools.count()
        self.num_passed_over = 0  # admissions that went ahead of a tenant over its live share
        # prefill beside decode rows within an inter-token target (the worker sets it)
        self.itl_budget = None
        self.last_allowance = None  # the last step's StepAllowance (None: no decode rows or no budget)
        self.budget_steps = {"itl": 0, "ttft": 0}  # batches beside decode rows, by which target set their room
        self.clock = time.monotonic  # what the queue's waits are read against (Req.arrival's clock)
        self.last_batch: Batch | None = None
        self.num_batches = 0  # batches handed out; with last_batch, what the step timer reads

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_tokens(self) -> int:
        """Tokens the waiting requests hold (what they will need pages for, at most)."""
        return sum(len(r.token_ids) for r in self.waiting) if self.waiting else 0

    @property
    def tokens_to_place(self) -> int:
        """Tokens that will still need pages: the waiting requests' and the rest of the admitted
        prompts' (their pages are taken a chunk at a time)."""
        rest = sum(r.remaining for r in self.running if not r.is_decoding)
        return self.waiting_tokens + rest

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(r.remaining for r in self.waiting) + sum(
            r.remaining for r in self.running if not r.is_decoding)

    def add(self, req: Req, front: bool = False) -> None:
        req.status = ReqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(req)
        group = self._groups.setdefault(_group(req), deque())
        (group.appendleft if front else group.append)(req)
        if front:
            self._retracted.add(req.rid)

    def add_running(self, req: Req) -> None:
        """A request whose KV is already in place (decode side of a transfer)."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._take_waiting(req)

    def _take_waiting(self, req: Req) -> None:
        self.waiting.remove(req)
        self._retracted.discard(req.rid)
        key = _group(req)
        group = self._groups[key]
        group.remove(req)
        if not group:
            del self._groups[key]

    def _turn_order(self) -> list[Req]:
        """Who may be admitted next, in order: the retracted requests (the queue's front), then
        each group's head, the group admitted from longest ago first (a group never admitted
        from first, then the oldest head). The tenant quota picks from this order."""
        order = list(itertools.takewhile(lambda r: r.rid in self._retracted, self.waiting))
        heads = sorted((g[0] for g in self._groups.values() if g[0].rid not in self._retracted),
                       key=lambda r: (self._served.get(_group(r), -1), r.arrival))
        return order + heads

    def _after_turn(self, order: list[Req], req: Req) -> list[Req]:
        """The turn order once req was admitted, without sorting again (what _turn_order would
        give): req leaves; its group, served last now, goes to the end with its next head (the
        one key that changed); the retracted front and the other heads keep their places."""
        group = _group(req)
        front = sum(1 for _ in itertools.takewhile(lambda r: r is req or r.rid in self._retracted, order))
        heads = [r for r in order[front:] if r is not req]  # its group had no other head here
        nxt = self._groups.get(group)
        if nxt and nxt[0].rid not in self._retracted:
            heads.append(nxt[0])
        return [r for r in order[:front] if r is not req] + heads

    def schedule(self, decode_row_tokens: int = 1) -> Batch:
        """decode_row_tokens: what a decode row may carry in the step (K + 1 while speculation
        drafts K: the drafts are attached after the prompt chunks are cut, so the budget leaves
        them room)."""
        # host-tier copies: settle what landed, write back ahead of what the queue needs (never waits)
        self.kv.tick_tiers(self.tokens_to_place)
        batch = Batch()
        budget = self.max_batched_tokens
        # 1. decodes: each needs room for one more token. Victims of retraction are always
        # younger than the request that needs the page (so never one already in this batch);
        # with no younger one left, the request itself waits.
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING or not req.is_decoding:
                continue
            if self._awaiting_result(req) or self._loading(req):
                continue
            while not self.kv.grow(req, req.num_computed + 1):
                victim = self._youngest_after(req)
                if victim is None:
                    self._retract(req)
                    break
                self._retract(victim)
            if req.status is not ReqStatus.RUNNING:
                continue
            if req.scheduled_at is None:  # joined running with its KV in place (a handoff, a fork)
                req.scheduled_at = self.clock()
            batch.items.append(ScheduledReq(req, req.num_computed, 1))
            budget -= 1
        rows = len(batch.items)
        room = None
        if self.itl_budget is not None and rows:
            queue = self.prefill_queue() if self.itl_budget.weighs_queue else ()
            room = self.itl_budget.begin(rows, sum(it.start + 1 for it in batch.items), queue, budget,
                                         row_tokens=decode_row_tokens)
        self.last_allowance = room
        # 2. prefill chunks of admitted requests, then new admissions (turn order)
        for req in self.running:
            if budget <= 0:
                break
            if req.status is ReqStatus.RUNNING and not req.is_decoding and not self._awaiting_result(req) \
                    and not self._loading(req):
                item = self._budgeted_chunk(req, budget, room)
                if item is None:
                    break
                batch.items.append(item)
                budget -= item.length
        turn_order = self._turn_order() if self.waiting else []  # sorted once a step, then kept
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.kv.next_in_turn(turn_order, lambda r: r.scope.tenant)
            taken = self._take_adapter(req)
            if taken is None:  # its adapter could not be loaded: the engine ends it
                turn_order = self._turn_order()
                continue
            if not taken:
                break  # every LoRA slot is pinned by other adapters' work: wait, as for pages
            self.kv.match_prefix(req)
            if req.host_pages_waiting and self.running:
                # part of its prefix waits in the host tier for device room: wait for running
                # requests to free it rather than recompute what is held (alone, go ahead)
                self.kv.drop_prefix(req)
                self._drop_adapter(req)
                break
            if req.num_cached_tokens == 0:
                req.num_cached_tokens = req.num_computed
            item = None if self._loading(req) else self._budgeted_chunk(req, budget, room)
            if item is None and req.kv_load_ticket is None:
                self.kv.drop_prefix(req)
                self._drop_adapter(req)
                break  # back-pressure (or the step's inter-token budget is spent)
            self._take_waiting(req)
            self._turn(_group(req))
            if req is not turn_order[0]:
                self.num_passed_over += 1
            turn_order = self._after_turn(turn_order, req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            if item is not None:  # else admitted with its pages locked: its chunk once the load lands
                batch.items.append(item)
                budget -= item.length
        stuck = [r for r in self.running if not self._awaiting_result(r) and r.kv_load_ticket is None]
        if not batch.items and len(stuck) > 1 and not self.kv.writing_back:
            # admitted prefills hold all the pages between them: free the youngest so the
            # oldest can finish (otherwise none ever would); copies in flight free pages as they land
            self._retract(stuck[-1])
        if batch.items:
            self.last_batch = batch
            self.num_batches += 1
            if room is not None:
                self.budget_steps[room.slo] += 1
        return batch

    def prefill_queue(self) -> Iterator[QueuedPrefill]:
        """The prefill work here in about the order it is served (admitted prompts, then the
        waiting ones, retracted first, then by arrival), with how long each has waited: what the
        step budget weighs against the first-token target (lazily: it reads as far as it needs)."""
        now = self.clock()
        admitted = (r for r in self.running if not r.is_decoding)  # a waiting request never decodes
        for r in itertools.islice(itertools.chain(admitted, self.waiting), MAX_WEIGHED_QUEUE):
            tokens = len(r.token_ids) - r.num_computed  # Req.remaining, inlined: read every step
            if tokens > 0:
                yield QueuedPrefill(tokens, max(0.0, now - r.arrival), len(r.token_ids) == len(r.prompt_ids))

    def _turn(self, group: str) -> None:
        self._served[group] = next(self._turns)
        if len(self._served) > 4 * (len(self._groups) + 1024):  # forget groups long gone
            self._served = {g: t for g, t in self._served.items() if g in self._groups}

    def _loading(self, req: Req) -> bool:
        """Its prefix's load back from the host tier has not been seen landed yet."""
        if req.kv_load_ticket is not None and self.kv.copy_landed(req.kv_load_ticket):
            req.kv_load_ticket = None
        return req.kv_load_ticket is not None

    @staticmethod
    def _awaiting_result(req: Req) -> bool:
        """Overlap scheduling: the request's next token is still being sampled on the device
        and nothing can be computed for it now: a prefill-only request whose prompt is done,
        or one whose pending token is its last (max_tokens). Never scheduled nor retracted
        meanwhile: its in-flight result must find it as it was."""
        return req.remaining <= 0 or (req.is_decoding and req.num_output >= req.max_new_tokens)

    def _budgeted_chunk(self, req: Req, budget: int, room) -> ScheduledReq | None:
        """_chunk within the step's inter-token room too (room None: the token budget only)."""
        item = self._chunk(req, budget if room is None else min(budget, room.allow(req.num_computed)))
        if item is not None and room is not None:
            room.charge(item.start, item.length)
        return item

    def _chunk(self, req: Req, budget: int) -> ScheduledReq | None:
        """The next prefill chunk that fits both the budget and free pages (keeping one
        page per decoding request in hand so admissions do not starve decodes)."""
        keep = sum(1 for r in self.running if r.is_decoding)
        have = len(req.page_ids) * self.kv.page_size - req.num_computed

        def fits(pages: int) -> int:  # tokens a chunk can take: its own pages' room and `pages` less the reserve
            return have + max(pages - keep, 0) * self.kv.page_size
        length = min(req.remaining, budget, fits(self.kv.available))
        if length <= 0:
            return None
        # a chunk never takes a page whose write-back copy is in flight (that copy, of a page
        # worth keeping, would be given up): what is free now, the rest once the copy lands
        if not self.kv.grow(req, req.num_computed + length, keep_copies=True):
            length = min(length, fits(self.kv.allocator.num_free))
            if length <= 0 or not self.kv.grow(req, req.num_computed + length, keep_copies=True):
                return None
        if req.scheduled_at is None:
            req.scheduled_at = self.clock()
        req.prefill_chunks += 1
        return ScheduledReq(req, req.num_computed, length)

    def _take_adapter(self, req: Req) -> bool | None:
        """Pin a device slot with req's LoRA adapter (True; also for the base model); False: no
        slot is free now; None: the adapter could not be loaded (req left the queue for `failed`)."""
        if not req.scope.adapter or self.lora is None:
            return True
        from .lora.adapter_files import LoraAdapterError
        try:
            slot = self.lora.acquire(req.scope.adapter, req.rid)
        except (LoraAdapterError, OSError) as exc:
            self._take_waiting(req)
            self.failed.append((req, str(exc)))
            return None
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _drop_adapter(self, req: Req) -> None:
        if self.lora is not None:
            self.lora.release(req.rid)
            req.lora_slot = -1

    def _youngest_after(self, req: Req) -> Req | None:
        """The youngest running request admitted after `req`, if any."""
        idx = self.running.index(req)
        for other in reversed(self.running[idx + 1:]):
            if other.status is ReqStatus.RUNNING and not self._awaiting_result(other):
                return other
        return None

    def _retract(self, req: Req) -> None:
        """Free a running request's pages and queue it again at the front; its tokens so
        far are kept and recomputed (sampling is keyed on position, so nothing changes)."""
        self.running.remove(req)
        self.kv.release(req, cache=False)
        self._drop_adapter(req)
        req.num_computed = 0
        req.num_kv_ready = 0
        self.num_retracted += 1
        self.add(req, front=True)


def _group(req: Req) -> str:
    """The fairness key: the client request it came from, else itself."""
    return req.request_group or req.out_rid
