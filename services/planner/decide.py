"""The planner's decision: keep the current split of the workers, or move to the split predicted
best (predict.py), with hysteresis and a minimum dwell time so it does not flap.

Every reading ends in one Decision: `switch` (roles change now), `hold` (another split is better
but the margin or the dwell time stops it) or `keep` (the current split is the best, or there
is too little to judge by). Rules, in order:
- a split that cannot serve (no `both` worker and no prefill + decode pair: a worker died) is
  left at once for the best servable one, whatever the dwell (reason `unservable`); but not
  before the workers were first seen able to serve: while they start and join one by one the
  planner keeps the roles they were started in (`starting`);
- no step model published yet (`no_model`), or fewer requests in the window than
  `--planner-min-requests` (`idle`): keep;
- the best split (lowest score; ties go to the current split, then to the fewest role changes)
  replaces the current one only if the current one's score is higher by more than the
  hysteresis (`--planner-hysteresis`) and the current split has stood `--planner-dwell` seconds
  (from the planner's start, and from its last change); the reason is `slo` when the current
  split is predicted past a target, else `headroom`;
- a current split that meets every target with room to spare (its worst ratio at most
  `--planner-headroom-above`) is held (reason `meets_targets`): a switch drains the requests
  under way on their old roles and moves prefill away from the pages it left, which a
  predicted margin the targets do not need does not pay for;
- a current split working off a backlog (the window's peak of queued prompt tokens: a burst of
  new conversations, the first turns of a lockstep chat) that it clears within the dwell, at a
  rate beside the burst its prefill keeps up with (at most SATURATED of its time: the arrivals
  outside the window's busiest reading interval where it stands out, load_window.py; the burst's own arrivals are
  its backlog, not a rate), and long enough to
  weigh (at least half the first-token target), is held (reason `backlog`): the queued requests
  stay on the workers they were placed on whatever the roles become, so a switch helps none of
  them; it only moves the load that comes after the burst, on readings the burst distorts
  (its first-token wait, and the inter-token latency of steps that carried its chunks). The hold
  lasts while the burst is in the window. When it leaves, the window starts again and the split
  stands another dwell (reason `after_backlog`): the readings that followed the burst still carry
  its tail (the inter-token latency of its chunks, its last first tokens), so the decision after
  it weighs only the load that stays.
  (Measured before this rule on two H200s: lockstep chats switched two `both` workers to the
  split under each burst of first turns, and their cached turns then ran on the split.)
  Neither hold stops a split becoming every worker `both` (`widens`): no worker loses a role, no
  capacity leaves any, the prompts the gateways' admission still holds back can then be prefilled
  on every GPU, and the usual burst, the first turns of conversations, is what `both` workers
  serve best once the cached turns follow. That move is still judged on readings the burst
  distorts, and the hand-over after it moves part of the decode worker's streams onto a worker
  still working off the burst. (Measured with the hold on that move too, two H200s: 48 lockstep
  chats met the split, the hold kept it through turns 2 and 3, TTFT p90 591 / 610 ms and TPOT p50
  14.4 ms against 466 / 491 ms and 10.3 ms on two `both` workers; it switched at turn 4.)
Kubernetes pool sizes change by the same rules, one pod at a time (`pool_step`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.planner.correction_memory import CorrectionMemory
from services.planner.load_window import Load
from services.planner.predict import (SATURATED, WAYS, Backlog, Corrections, Fleet, Prediction, Split, backlog,
                                      candidates, predict, way)

ACTIONS = ("switch", "scale", "hold", "keep")
REASONS = ("unservable", "slo", "headroom", "hysteresis", "meets_targets", "backlog", "after_backlog", "dwell",
           "idle", "no_model", "best", "starting", "failed")
RESTARTS_WINDOW = ("after_backlog",)  # holds after which the window starts again (main.py)


@dataclass(frozen=True)
class Decision:
    action: str               # switch | hold | keep (scale: pool_step's)
    reason: str
    current: Split
    target: Split             # the split wanted now (the current one when keeping)
    load: Load
    predictions: dict = field(default_factory=dict)  # Split -> Prediction
    corrections: Corrections = Corrections()
    backlog: Backlog | None = None  # the current split's, where one was weighed
    by_way: dict = field(default_factory=dict)  # way of serving -> the Corrections its splits were predicted by

    def prediction(self, split: Split) -> Prediction | None:
        return self.predictions.get(split)


def moves(a: Split, b: Split) -> int:
    """Workers whose role differs between two splits of as many workers."""
    return (abs(a.prefill - b.prefill) + abs(a.decode - b.decode) + abs(a.both - b.both)) // 2


def widens(current: Split, target: Split) -> bool:
    """Every worker `both` from a split: each keeps serving the role it had and takes the other
    too, so the work queued on each stays served where it is and none of it waits on a drain."""
    return target.both == target.workers and current.both < current.workers


def best_of(preds: dict, current: Split) -> Prediction:
    return min(preds.values(), key=lambda p: (p.score, p.split != current, moves(p.split, current), p.split))


@dataclass
class Decider:
    hysteresis: float
    dwell_s: float
    min_requests: int
    changed_at: float  # monotonic: the planner's start, then each change it made
    served: bool = False  # the workers were seen able to serve at least once
    headroom_above: float = 0.0  # a split meeting every target with its worst ratio at most this is held
    bursting: bool = False  # the last weighing held the split for a backlog it was working off
    memory: CorrectionMemory = field(default_factory=CorrectionMemory)  # correction factors by way of serving

    def dwelt(self, now: float) -> bool:
        return now - self.changed_at >= self.dwell_s

    def changed(self, now: float) -> None:
        """A change was made at `now` (a switch, or a pool step)."""
        self.changed_at = now

    def clears_within_dwell(self, b: Backlog, fleet: Fleet) -> bool:
        """The current split is working off a burst it clears within the dwell (the module's rule)."""
        return fleet.ttft_target_s / 2 <= b.clear_s <= self.dwell_s and b.busy <= SATURATED

    def decide(self, now: float, current: Split, fixed: Split, load: Load, fleet: Fleet | None) -> Decision:
        options = candidates(current.workers, fixed)
        self.served = self.served or current.servable
        if not options:  # no worker, or none that may switch into a servable split
            return Decision("keep", "best", current, current, load)
        if not current.servable and not self.served:
            return Decision("keep", "starting", current, current, load)
        if not current.servable and options:
            if fleet is None:  # no model: any servable split beats none; the one with fewest changes
                target = min(options, key=lambda s: (moves(s, current), s))
                return Decision("switch", "unservable", current, target, load)
            corr = Corrections()
            preds = {s: predict(s, load, fleet, corr) for s in options}
            return Decision("switch", "unservable", current, best_of(preds, current).split, load, preds, corr)
        if fleet is None:
            return Decision("keep", "no_model", current, current, load)
        corr = Corrections.of(current, load, fleet)
        serving, queued = way(current, load), backlog(current, load, fleet)
        burst = load.backlog_tokens > 0 and self.clears_within_dwell(queued, fleet)
        if load.requests >= self.min_requests and not (burst or self.bursting):
            # not a burst's readings (its first-token waits, the steps its chunks stretched): they
            # would stand for this way for the memory's span once the split changes
            self.memory.note(serving, corr, now)
        by_way = {w: self.memory.for_way(w, serving, corr, now) for w in WAYS}
        preds = {s: predict(s, load, fleet, by_way[way(s, load)]) for s in {*options, current}}

        def decided(action: str, reason: str, target: Split = current, weighed: Backlog | None = None) -> Decision:
            return Decision(action, reason, current, target, load, preds, corr, weighed, by_way)
        if load.requests < self.min_requests:
            return decided("keep", "idle")
        best = best_of({s: p for s, p in preds.items() if s in options}, current)
        if best.split == current:
            self.bursting = False
            return decided("keep", "best")
        now_score = preds[current].score
        if not now_score > best.score * (1 + self.hysteresis):
            return decided("hold", "hysteresis", best.split)
        if now_score <= self.headroom_above:
            return decided("hold", "meets_targets", best.split)
        wider = widens(current, best.split)  # no role leaves any worker: neither backlog hold applies
        if not wider and burst:
            self.bursting = True
            return decided("hold", "backlog", best.split, queued)
        if self.bursting and not wider:  # the burst just left the window: judge what stays, on its own readings
            self.bursting = False
            self.changed(now)
            return decided("hold", "after_backlog", best.split, queued)
        if not self.dwelt(now):
            return decided("hold", "dwell", best.split, queued)
        self.bursting = False
        return decided("switch", "slo" if now_score > 1 else "headroom", best.split, queued)


@dataclass(frozen=True)
class PoolStep:
    pool: str      # prefill | decode
    delta: int     # +1 or -1
    reason: str    # slo (a target missed at the best split) | headroom (fewer pods still meet them)
    prediction: Prediction  # the best split after the step


def pool_step(live: int, load: Load, fleet: Fleet, corrections: Corrections, hysteresis: float,
              room: dict[str, tuple[int, int, int]], by_way: dict | None = None) -> PoolStep | None:
    """One pod more or fewer in a pool, or None. `room`: pool -> (replicas, min, max). A pod is
    added where the best split of one more worker puts it, when even the best split of the
    workers there are misses a target; one is removed where the best split of one fewer worker
    takes it, when that split still meets every target with the hysteresis to spare. Each split
    is predicted by its way's correction factors (`by_way`, Decision.by_way), else `corrections`."""
    by_way = by_way or {}

    def best(n: int) -> Prediction | None:
        if n < 1:
            return None
        preds = {s: predict(s, load, fleet, by_way.get(way(s, load), corrections)) for s in candidates(n)}
        return min(preds.values(), key=lambda p: (p.score, p.split))

    now = best(live)
    if now is None:
        return None
    if now.score > 1:
        more = best(live + 1)
        if more is not None and more.score < now.score:
            first = "prefill" if more.split.prefill > now.split.prefill else "decode"
            for pool in (first, "decode" if first == "prefill" else "prefill"):
                replicas, _, most = room[pool]
                if replicas < most:
                    return PoolStep(pool, +1, "slo", more)
        return None
    fewer = best(live - 1)
    if fewer is not None and math.isfinite(fewer.score) and fewer.score * (1 + hysteresis) <= 1:
        first = "prefill" if fewer.split.prefill < now.split.prefill else "decode"
        for pool in (first, "decode" if first == "prefill" else "prefill"):
            replicas, least, _ = room[pool]
            if replicas > least:
                return PoolStep(pool, -1, "headroom", fewer)
    return None
