"""Admission by work: what a request asks of the workers, not how many HTTP requests there are.

A request is a set of units, one per prompt (a /v1/completions prompt list has several), each
weighing `n` sequences, the KV tokens they can fill (prompt + n x max_tokens) and its prompt
tokens. Units run while the running ones fit the budget: at most `sequences` sequences (by
default the live workers' batch capacity), when set `tokens` KV tokens, and `prefill_tokens`
prompt tokens not yet prefilled by the prefill and `both` workers (by default a couple of
their steps: a unit counts there from its grant to its first token, whole until routed, then
only the part the chosen worker does not hold, and nothing when a decode worker prefills it:
`Grant.routed`). So the workers' own queues stay short and
the order in which work reaches them is decided here, fairly. A unit alone always runs (what
can never fit a worker was refused with a 400 before). The prefill budget is shared: when it
is full, a tenant holding less than its share of it (the budget over the tenants with work
running or waiting) still gets a unit through, so a newcomer's prompt reaches the workers at
once (their engines take turns by request) instead of after a prompt list's prompts drain.
Likewise the last sixteenth of the sequence budget is kept for tenants holding less than
their share of it counting one tenant more: prompt lists that fill the batch between them
leave a newcomer a place in it, which they could otherwise hold for minutes.

Fairness: waiting units are served by tenant (an API key, else the request itself), the
tenant with the smallest dominant share of the running work first (its sequences or tokens
over the budget, whichever is larger); within a tenant, the request with the fewest running
sequences first (one key's small request is not queued behind the same key's prompt list);
within a request, in order. A unit that does not fit the budget yet is passed by the next
ones in that order that do fit (a long prompt waiting for the prefill budget does not hold up
a short one), until it has waited `aging_s`: from then on nobody passes it, so the room freed
meanwhile is its and a big unit is never starved. One
request runs at most `max_request_share` of the sequence budget at once (its other prompts
wait behind its own), so a newcomer finds room at once; and a prompt list of 1024 cannot
fill the workers ahead of another user's one-token request: when room frees, the user with
the smaller share goes first.

Each model served is a pool of its own: its units are weighed against the budget of its own
workers (`budget(pool)`, the pool being the base model's name), the running work and the tenants'
shares are counted per pool, and a unit that has aged holds up only its own pool. So a burst
of one model's prompts neither fills another model's workers' room nor keeps that model's
requests waiting while its workers idle.

Bounds against overload, in requests: at most `max_concurrent` requests are admitted at
once and `max_queued` more hold a place (preparing or waiting); a request that finds no
place is refused at once, one whose first unit waits past `queue_timeout_s` too (the HTTP
layer answers 429 with Retry-After). Later units of an admitted request wait without a
deadline (the request is running; its client may leave, which cancels them).

One AdmissionQueue per gateway, used from the event loop only (no locks). A Ticket is one
request: `hold_place()`, `await acquire(work)` for its first unit, `await acquire_more(work)`
for the others; each returns a Grant to `release()` when that unit ends; `ticket.release()`
ends the request (releases whatever it still holds; idempotent).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace


NEWCOMER_ROOM = 16  # 1/16 of the sequence budget is kept for tenants with little running


class AdmissionRefused(Exception):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Work:
    """One unit: a prompt's n sequences, the KV tokens they can fill, its prompt tokens."""

    sequences: int = 1
    tokens: int = 0
    prompt_tokens: int = 0
    pool: str = ""  # the base model whose workers run it (each model's budget is its own)


@dataclass(frozen=True)
class Budget:
    """What may run at once; 0 = no bound on that resource."""

    sequences: int = 0
    tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens granted and not yet past their first token


@dataclass
class AdmissionStats:
    active: int
    queued: int
    refused: int
    running_sequences: int = 0
    running_tokens: int = 0
    waiting_sequences: int = 0
    prefilling_tokens: int = 0


@dataclass
class _Share:
    sequences: int = 0
    tokens: int = 0
    prefill_tokens: int = 0


@dataclass
class _Pool:
    """One model's admitted work: what runs, and each tenant's part of it."""

    running: _Share = field(default_factory=_Share)
    tenants: dict[str, _Share] = field(default_factory=dict)


@dataclass(eq=False)
class _Waiter:
    ticket: "Ticket"
    work: Work
    first: bool  # the request's first unit (counts as a queued request; has a deadline)
    order: int
    since: float  # when it started waiting (the queue's clock): aging
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float, retry_after_s: float = 1.0,
                 *, budget: Callable[[str], Budget] | None = None, max_request_share: float = 1.0,
                 aging_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 pools: Callable[[], Iterable[str]] = lambda: ("",)):
        if min(max_concurrent, max_queued, queue_timeout_s, aging_s) < 0 or not 0 < max_request_share <= 1:
            raise ValueError("admission limits must be >= 0, the request share in (0, 1]")
        self.aging_s = aging_s  # a unit that does not fit is passed until it has waited this long
        self.clock = clock
        self.max_concurrent = max_concurrent  # requests admitted at once; 0 = unbounded (no queue either)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s  # 0 = wait without a deadline
        self.retry_after_s = retry_after_s
        self.max_request_share = max_request_share  # of the sequence budget; 1 = the whole budget
        self.budget = budget or (lambda pool: Budget())  # pool -> its budget, read at each decision: the live workers change
        self.pools = pools  # the pools served (the gauges' budgets add theirs up)
        self.active = 0  # requests admitted (first unit granted) and not yet ended
        self.places = 0  # requests holding a place: admitted, waiting or being prepared
        self.refused = 0
        self.cached_prompt_tokens = 0  # taken off the prefill budget at routing (Grant.routed), since start
        self.local_prefill_prompt_tokens = 0  # prefilled by a decode worker, off the budget since routing (Grant)
        self._pools: dict[str, _Pool] = {}
        self._waiters: list[_Waiter] = []
        self._order = itertools.count()

    # --- reading -------------------------------------------------------------------------

    @property
    def running(self) -> _Share:
        """What runs, over every pool."""
        pools = self._pools.values()
        return _Share(sum(p.running.sequences for p in pools), sum(p.running.tokens for p in pools),
                      sum(p.running.prefill_tokens for p in pools))

    def budget_total(self) -> Budget:
        """The budgets of the pools served, added up (the gauges)."""
        each = [self.budget(pool) for pool in self.pools()]
        return Budget(sum(b.sequences for b in each), sum(b.tokens for b in each),
                      sum(b.prefill_tokens for b in each))

    def _pool(self, name: str) -> _Pool:
        return self._pools.setdefault(name, _Pool())

    @property
    def queued(self) -> int:
        """Requests whose first unit waits."""
        return sum(1 for w in self._waiters if w.first and not w.future.done())

    @property
    def waiting_sequences(self) -> int:
        return sum(w.work.sequences for w in self._waiters if not w.future.done())

    def waiting_prompt_tokens_of(self, pool: str) -> int:
        """Prompt tokens of one pool's units waiting for admission: a burst the prefill budget
        holds here rather than in the workers' queues (a route of that model tells the router;
        the planner weighs both as its backlog)."""
        return sum(w.work.prompt_tokens for w in self._waiters if not w.future.done() and w.work.pool == pool)

    def stats(self) -> AdmissionStats:
        running = self.running
        return AdmissionStats(self.active, self.queued, self.refused, running.sequences, running.tokens,
                              self.waiting_sequences, running.prefill_tokens)

    def ticket(self, tenant: str | None = None) -> "Ticket":
        return Ticket(self, tenant)

    # --- deciding --------------------------------------------------------------------------

    def _share(self, tenant: str, pool: str, budget: Budget) -> float:
        """Dominant share of the pool's running work (sequences or tokens over its budget)."""
        mine = self._pool(pool).tenants.get(tenant)
        if mine is None:
            return 0.0
        seqs = mine.sequences / budget.sequences if budget.sequences else float(mine.sequences)
        toks = mine.tokens / budget.tokens if budget.tokens else 0.0
        return max(seqs, toks)

    def _fits_budget(self, work: Work, budget: Budget, tenant: str, tenants: int) -> bool:
        """tenants: how many have work of the pool running or waiting (the fair shares)."""
        pool = self._pool(work.pool)
        run = pool.running
        if run.sequences == 0:
            return True  # alone, a unit always runs
        mine = pool.tenants.get(tenant) or _Share()
        if budget.sequences:
            total = run.sequences + work.sequences
            if total > budget.sequences:
                return False
            # the last sixteenth of the batch is kept for tenants below their share counting one
            # more (a newcomer): two prompt lists cannot fill the batch ahead of a third client
            if total > budget.sequences - budget.sequences // NEWCOMER_ROOM \
                    and mine.sequences + work.sequences > budget.sequences / (tenants + 1):
                return False
        if budget.tokens and run.tokens + work.tokens > budget.tokens:
            return False
        if not budget.prefill_tokens or not run.prefill_tokens \
                or run.prefill_tokens + work.prompt_tokens <= budget.prefill_tokens:
            return True
        # the budget is full, but each tenant is owed its share of it: a newcomer's prompt goes to
        # the workers now (their engines take turns by request) instead of after the bulk's
        # prompts drain; what this lets through stays below another prefill budget in all
        return mine.prefill_tokens + work.prompt_tokens <= budget.prefill_tokens / max(tenants, 1)

    def request_bound(self, budget: Budget) -> int:
        """Sequences one request may run at once (0: no bound beyond the budget)."""
        if not budget.sequences or self.max_request_share >= 1:
            return 0
        return max(1, int(budget.sequences * self.max_request_share))

    def _blocked_by_request(self, w: _Waiter, bound: int) -> bool:
        held = w.ticket.running_sequences
        if w.first and self.max_concurrent and self.active >= self.max_concurrent:
            return True
        return bool(bound and held and held + w.work.sequences > bound)

    def _dispatch(self) -> None:
        """Grant waiting units, fairest tenant first, while some fit: one that does not fit
        yet is passed by the next that do, unless it has waited `aging_s` (then it waits for
        room and nobody passes it)."""
        self._waiters = [w for w in self._waiters if not w.future.done()]
        while self._waiters:
            w = self._next_grant()
            if w is None:
                return
            self._waiters.remove(w)
            self._take(w.ticket, w.work, w.first)
            w.future.set_result(None)

    def _next_grant(self) -> _Waiter | None:
        budgets: dict[str, Budget] = {}

        def budget_of(pool: str) -> Budget:
            if pool not in budgets:
                budgets[pool] = self.budget(pool)
            return budgets[pool]

        heads: dict[int, _Waiter] = {}
        for w in self._waiters:  # each request's oldest unit that the request's bound lets run
            if id(w.ticket) not in heads and not self._blocked_by_request(w, self.request_bound(budget_of(w.work.pool))):
                heads[id(w.ticket)] = w
        now = self.clock()
        tenants: dict[str, int] = {}  # pool -> tenants with its work running or waiting
        for pool in {h.work.pool for h in heads.values()}:
            waiting = {w.ticket.tenant for w in self._waiters if w.work.pool == pool}
            tenants[pool] = len(set(self._pool(pool).tenants) | waiting)
        held: set[str] = set()  # pools whose freed room an aged unit waits for
        for w in sorted(heads.values(), key=lambda h: (self._share(h.ticket.tenant, h.work.pool, budget_of(h.work.pool)),
                                                       h.ticket.running_sequences, h.order)):
            if w.work.pool in held:
                continue
            if self._fits_budget(w.work, budget_of(w.work.pool), w.ticket.tenant, tenants[w.work.pool]):
                return w
            if now - w.since >= self.aging_s:
                held.add(w.work.pool)  # it has waited long enough: the room its pool frees from now on is its
        return None

    def _take(self, ticket: "Ticket", work: Work, first: bool) -> None:
        if first:
            self.active += 1
            ticket.admitted = True
        pool = self._pool(work.pool)
        for share in (pool.running, pool.tenants.setdefault(ticket.tenant, _Share())):
            share.sequences += work.sequences
            share.tokens += work.tokens
            share.prefill_tokens += work.prompt_tokens
        ticket.running_sequences += work.sequences

    def _prefilled(self, ticket: "Ticket", work: Work) -> None:
        self._uncharge(ticket, work.pool, work.prompt_tokens)

    def _charge_prefill(self, ticket: "Ticket", pool_name: str, prompt_tokens: int) -> None:
        pool = self._pool(pool_name)
        pool.running.prefill_tokens += prompt_tokens
        pool.tenants[ticket.tenant].prefill_tokens += prompt_tokens

    def _uncharge(self, ticket: "Ticket", pool_name: str, prompt_tokens: int) -> None:
        pool = self._pool(pool_name)
        pool.running.prefill_tokens -= prompt_tokens
        pool.tenants[ticket.tenant].prefill_tokens -= prompt_tokens
        assert pool.running.prefill_tokens >= 0, "prefill tokens released twice"

    def _give_back(self, ticket: "Ticket", work: Work, prefilling: bool = True) -> None:
        if prefilling:
            self._prefilled(ticket, work)
        pool = self._pool(work.pool)
        share = pool.tenants[ticket.tenant]
        for s in (pool.running, share):
            s.sequences -= work.sequences
            s.tokens -= work.tokens
        assert pool.running.sequences >= 0 and pool.running.tokens >= 0, "admitted work released twice"
        if share.sequences == 0 and share.tokens == 0 and share.prefill_tokens == 0:
            del pool.tenants[ticket.tenant]
        ticket.running_sequences -= work.sequences

    async def _wait(self, ticket: "Ticket", work: Work, first: bool) -> None:
        waiter = _Waiter(ticket, work, first, next(self._order), self.clock())
        self._waiters.append(waiter)
        self._dispatch()
        if waiter.future.done():
            return
        timeout = (self.queue_timeout_s or None) if first else None
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self._give_back(ticket, work)  # granted just as we gave up: pass the room on
                if first:
                    self.active -= 1
                    ticket.admitted = False
            else:
                waiter.future.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            self._dispatch()
            raise

    def _refuse(self, why: str) -> AdmissionRefused:
        self.refused += 1
        return AdmissionRefused(f"the gateway is at capacity ({why})", self.retry_after_s)


class Grant:
    """One admitted unit: `prefilled()` at its first token, `release()` when it ends (both
    idempotent)."""

    def __init__(self, ticket: "Ticket", work: Work):
        self._ticket = ticket
        self.work = work
        self.prompt_tokens = work.prompt_tokens  # the whole prompt: each route's cached count is of it
        self.held = True
        self.prefilling = True
        self.local_off = 0  # prompt tokens taken off the prefill budget for a decode worker to prefill

    def routed(self, cached_tokens: int, local_prefill: bool = False) -> None:
        """The route's word on how many of the prompt's tokens the chosen worker already holds:
        only the rest is prefill work, so only the rest stays on the prefill budget, and the
        next unit may go at once. A later turn of a chat is mostly cached (96-98% of a 6k-token
        context): charged whole, two or three of them filled a prefill worker's budget, and a
        burst of them reached the workers that many at a time. local_prefill: a decode worker
        prefills the rest beside its rows (the router's local or overflow placement, or a stack
        with no prefill worker), outside the prefill and `both` workers whose prompts the budget
        bounds, so none of it stays there (held while the decode worker works through it in
        inter-token-budgeted slices, it kept that much of the prefill workers' room idle).
        Only lowers the charge for what a worker holds (a moved attempt routes again, to a
        worker that may hold less: counting that would make the prefill budget wait on a charge
        the first route already let go); but a moved attempt that a prefill or `both` worker
        prefills after a decode worker was to gets back what the local route took off, up to
        what the new worker does not hold: that is new work on the budget's workers."""
        if not (self.held and self.prefilling):
            return
        queue = self._ticket._queue
        charged = self.work.prompt_tokens  # 0 after a local route
        if self.local_off and not local_prefill:  # a decode worker was to prefill it, now a prefill or `both` one does
            back = max(0, min(self.local_off, max(0, self.prompt_tokens - max(0, cached_tokens))))
            if back:
                queue._charge_prefill(self._ticket, self.work.pool, back)
                self.work = replace(self.work, prompt_tokens=back)
            queue.cached_prompt_tokens += self.local_off - back  # what stays off: the new worker holds it
            self.local_off = 0
            return
        cached_off = min(charged, max(0, cached_tokens - (self.prompt_tokens - charged)))  # beyond earlier routes
        off = charged if local_prefill else cached_off
        if off <= 0:
            return
        self.local_off += off - cached_off
        queue._uncharge(self._ticket, self.work.pool, off)
        queue.cached_prompt_tokens += cached_off
        self.work = replace(self.work, prompt_tokens=charged - off)
        queue._dispatch()

    def prefilled(self) -> None:
        if self.held and self.prefilling:
            self.prefilling = False
            queue = self._ticket._queue
            queue.local_prefill_prompt_tokens += self.local_off  # what a decode worker did prefill
            queue._prefilled(self._ticket, self.work)
            queue._dispatch()

    def release(self) -> None:
        if self.held:
            self.held = False
            self._ticket._grants.discard(self)
            queue = self._ticket._queue
            queue._give_back(self._ticket, self.work, self.prefilling)
            queue._dispatch()


class Ticket:
    """One request's place in the AdmissionQueue."""

    def __init__(self, queue: AdmissionQueue, tenant: str | None = None):
        self._queue = queue
        self.tenant = tenant if tenant is not None else f"request-{id(self)}"  # unique while it lives
        self.admitted = False
        self.running_sequences = 0
        self._placed = False
        self._grants: set[Grant] = set()

    def hold_place(self) -> None:
        """Take a place among the requests admitted or waiting; AdmissionRefused when none is left."""
        if self._placed:
            return
        q = self._queue
        if q.max_concurrent and q.places >= q.max_concurrent + q.max_queued:
            raise q._refuse(f"{q.active} requests running and {q.places - q.active} waiting")
        q.places += 1
        self._placed = True

    async def acquire(self, work: Work = Work()) -> Grant:
        """The request's first unit: wait for room; AdmissionRefused when there is no place or
        the wait passes the queue timeout."""
        self.hold_place()
        try:
            await self._queue._wait(self, work, first=True)
        except BaseException as exc:
            self.release()  # refused or cancelled: the place goes to the next request
            if isinstance(exc, asyncio.TimeoutError):
                raise self._queue._refuse(f"no room within {self._queue.queue_timeout_s:g}s") from None
            raise
        return self._grant(work)

    async def acquire_more(self, work: Work) -> Grant:
        """Another unit of the admitted request (no deadline; cancel to stop waiting)."""
        if not self.admitted:
            raise RuntimeError("acquire_more before the request was admitted")
        await self._queue._wait(self, work, first=False)
        return self._grant(work)

    def _grant(self, work: Work) -> Grant:
        grant = Grant(self, work)
        self._grants.add(grant)
        return grant

    def release(self) -> None:
        q = self._queue
        for grant in list(self._grants):
            grant.release()
        if self.admitted:
            self.admitted = False
            q.active -= 1
            assert q.active >= 0, "admission slot released twice"
        if self._placed:
            self._placed = False
            q.places -= 1
        q._dispatch()
