"""The planner's decision model (services/planner/): the load a window of readings shows, the
splits predicted by the workers' step models, and the decision with hysteresis and a minimum
dwell time; which workers switch, in what order; one pod more or fewer in a Kubernetes pool.

The workers and the two loads (long single-turn prompts with answers streaming beside them,
then multi-turn chat whose turns are mostly cached where the conversation lives, as in
tests/e2e/test_e2e_planner.py) are tests/helpers/planner_fleet.py's."""
from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.gateway.http_edge.admission import AdmissionQueue, Budget, Work
from services.gateway.http_edge.admission_metrics import register_admission_metrics
from services.gateway.http_edge.metrics import GatewayMetrics
from services.planner.assign import assign, fixed_split, hand_overs
from services.planner.correction_memory import CorrectionMemory
from services.planner.decide import RESTARTS_WINDOW, Decider, pool_step
from services.planner.load_window import Load, LoadWindow, Reading
from services.planner.predict import BESIDE, SPLIT, Corrections, Fleet, Split, backlog, candidates, predict, way
from services.planner.report import figures
from services.planner.scrape import gateway_figures
from shared.perf_model.step_model import StepModel
from shared.registry.worker_info import WorkerInfo
from tests.helpers.planner_fleet import CHAT, LONG, long_prompts, worker


def fleet(*workers: WorkerInfo, ttft_s: float = 5.0) -> Fleet:
    return Fleet.of(list(workers) or [worker("w0", "prefill"), worker("w1", "decode")], ttft_s, 0.0)


def decider(**kw) -> Decider:
    return Decider(**{"hysteresis": 0.2, "dwell_s": 60.0, "min_requests": 20, "changed_at": 0.0, **kw})


P1D1, B2 = Split(1, 1, 0), Split(0, 0, 2)


def test_long_prompts_keep_the_split_and_multi_turn_chat_moves_every_worker_to_both():
    d, f = decider(), fleet()
    long = d.decide(100.0, P1D1, Split(), LONG, f)
    assert (long.action, long.reason, long.target) == ("keep", "best", P1D1)
    # the split keeps prefill out of the decode steps: both the ITL and the TTFT are lower
    split, both = long.prediction(P1D1), long.prediction(B2)
    assert split.itl_s < both.itl_s and split.ttft_s < both.ttft_s
    chat = d.decide(100.0, P1D1, Split(), CHAT, f)
    assert (chat.action, chat.target) == ("switch", B2) and chat.reason in ("slo", "headroom")
    # one worker carried every stream and its prefills; two share them
    assert chat.prediction(B2).itl_s * 1.2 < chat.prediction(P1D1).itl_s
    assert chat.prediction(B2).score * 1.2 < chat.prediction(P1D1).score


def test_a_split_changes_only_past_the_hysteresis():
    f = fleet()
    # fewer long prompts, fewer streams: the split is better than two `both` workers, by less than 20%
    light = Load(**{**LONG.__dict__, "requests_per_s": 0.2, "prompt_tokens_per_s": 50,
                    "computed_prompt_tokens_per_s": 50, "decode_streams": 0.5})
    back = decider().decide(100.0, B2, Split(), light, f)
    assert back.target == P1D1 and back.prediction(B2).score / back.prediction(P1D1).score < 1.2
    assert (back.action, back.reason) == ("hold", "hysteresis")
    eager = decider(hysteresis=0.1).decide(100.0, B2, Split(), light, f)
    assert (eager.action, eager.target) == ("switch", P1D1)
    assert decider().decide(100.0, B2, Split(), LONG, f).action == "switch"  # the full load: by more


def test_a_split_that_meets_every_target_with_room_to_spare_is_not_left_for_a_better_one():
    from services.planner.config import PlannerTiming

    default = PlannerTiming().headroom_above
    # the chat load with loose targets (TTFT 10 s, ITL 0.8 s): the split meets both at 0.61 of
    # the worst, two `both` workers are predicted at 0.39 (better by more than the hysteresis)
    loose = Fleet.of([worker("w0", "prefill"), worker("w1", "decode")], 10.0, 0.8)
    held = decider(headroom_above=default).decide(100.0, P1D1, Split(), CHAT, loose)
    assert held.prediction(P1D1).score <= default and held.prediction(B2).score * 1.2 < held.prediction(P1D1).score
    assert (held.action, held.reason, held.target) == ("hold", "meets_targets", B2)
    assert decider(headroom_above=0.0).decide(100.0, P1D1, Split(), CHAT, loose).reason == "headroom"
    # tighter (ITL 0.6 s): the split's worst ratio is past the level, so the better split is taken
    tighter = Fleet.of([worker("w0", "prefill"), worker("w1", "decode")], 10.0, 0.6)
    switch = decider(headroom_above=default).decide(100.0, P1D1, Split(), CHAT, tighter)
    assert switch.prediction(P1D1).score > default and (switch.action, switch.reason) == ("switch", "headroom")
    # past a target the level does not apply
    assert decider(headroom_above=default).decide(100.0, P1D1, Split(), CHAT, fleet()).reason == "slo"


def test_a_split_stands_its_dwell_time_from_the_start_and_from_each_change():
    d, f = decider(), fleet()
    assert (d.decide(30.0, P1D1, Split(), CHAT, f).action, d.decide(30.0, P1D1, Split(), CHAT, f).reason) == \
        ("hold", "dwell")
    assert d.decide(60.0, P1D1, Split(), CHAT, f).action == "switch"
    d.changed(100.0)
    held = d.decide(159.0, P1D1, Split(), CHAT, f)
    assert (held.action, held.reason, held.target) == ("hold", "dwell", B2)
    assert d.decide(160.0, P1D1, Split(), CHAT, f).action == "switch"


def test_a_burst_the_split_clears_within_the_dwell_holds_it_and_the_load_after_decides():
    """Two `both` workers under long prompts, which the split serves better (a switch), while a
    burst of queued prompts is in the window: the queued requests stay where they were placed
    whatever the roles become, so the planner holds (`backlog`) as long as the split clears the
    burst within the dwell at a rate its prefill keeps up with. A backlog it would take longer
    than the dwell to clear, or one it cannot work off at that rate, is no reason to wait."""
    d, f = decider(), fleet()  # dwell 60 s, TTFT target 5 s
    assert d.decide(100.0, B2, Split(), LONG, f).action == "switch"
    burst = Load(**{**LONG.__dict__, "backlog_tokens": 2000.0})
    b = backlog(B2, burst, f)
    assert f.ttft_target_s / 2 < b.clear_s < d.dwell_s and b.busy < 0.9
    held = d.decide(100.0, B2, Split(), burst, f)
    assert (held.action, held.reason, held.target) == ("hold", "backlog", P1D1)
    shown = figures(held, f)  # the span event's attributes and the log line's figures
    assert (shown["load.backlog_tokens"], shown["backlog.clear_s"]) == (2000.0, round(b.clear_s, 3))
    # the same burst on one prefill worker takes twice as long: each split clears at its own rate
    assert backlog(P1D1, burst, f).clear_s == pytest.approx(2 * b.clear_s, rel=0.05)
    # the burst leaves the window: the split stands another dwell, on a window restarted (main.py)
    after = d.decide(103.0, B2, Split(), LONG, f)
    assert (after.action, after.reason) == ("hold", "after_backlog") and after.reason in RESTARTS_WINDOW
    assert d.decide(110.0, B2, Split(), LONG, f).reason == "dwell"
    assert d.decide(163.0, B2, Split(), LONG, f).action == "switch"  # the load that stayed decides
    small = Load(**{**LONG.__dict__, "backlog_tokens": 200.0})  # a few steps' worth: no burst to wait for
    assert decider().decide(100.0, B2, Split(), small, f).action == "switch"
    flood = Load(**{**LONG.__dict__, "backlog_tokens": 30000.0})  # past the dwell
    assert backlog(B2, flood, f).clear_s > d.dwell_s and decider().decide(100.0, B2, Split(), flood, f).action == "switch"
    # long prompts past what two `both` workers prefill: the backlog only grows, the split can help
    past = Load(**{**long_prompts(1.5, 2.0).__dict__, "backlog_tokens": 2000.0})
    assert backlog(B2, past, f).busy > 0.9
    assert decider().decide(100.0, B2, Split(), past, f).action == "switch"


def test_a_burst_does_not_hold_a_split_from_becoming_every_worker_both():
    """Going from the split to every worker `both` takes no role and no capacity from any worker,
    so a burst of chats' first turns on the split is no reason to keep the split through the cached
    turns that follow (on two H200s the hold kept 48 lockstep chats on it through turns 2 and 3)."""
    d, f = decider(), fleet()
    burst = Load(**{**CHAT.__dict__, "backlog_tokens": 2000.0})
    assert d.clears_within_dwell(backlog(P1D1, burst, f), f)  # the burst the split would be held for
    moved = d.decide(100.0, P1D1, Split(), burst, f)
    assert (moved.action, moved.target) == ("switch", B2)
    # a split held for an earlier burst does not stand an `after_backlog` dwell before widening
    after = decider(bursting=True).decide(100.0, P1D1, Split(), CHAT, f)
    assert (after.action, after.target) == ("switch", B2)
    # the dwell still applies (60 s from the start), and holding for it keeps the burst in mind
    early = decider(bursting=True)
    assert early.decide(30.0, P1D1, Split(), burst, f).reason == "dwell" and early.bursting
    # the other way, the hold stands: two `both` workers under long prompts and a burst
    long_burst = Load(**{**LONG.__dict__, "backlog_tokens": 2000.0})
    assert decider().decide(100.0, B2, Split(), long_burst, f).reason == "backlog"


def test_too_little_load_or_no_model_keeps_the_split():
    d = decider()
    few = Load(**{**CHAT.__dict__, "requests": 19})
    assert (d.decide(100.0, P1D1, Split(), few, fleet()).reason) == "idle"
    assert Fleet.of([worker("w0", "prefill", model=None), worker("w1", "decode", model=None)], 5.0, 0.0) is None
    assert d.decide(100.0, P1D1, Split(), CHAT, None).reason == "no_model"


def test_workers_that_cannot_serve_are_fixed_at_once_but_not_while_they_join():
    d = decider()
    starting = d.decide(1.0, Split(1, 0, 0), Split(), Load(), fleet())
    assert (starting.action, starting.reason) == ("keep", "starting")  # the decode worker is still loading
    assert d.decide(2.0, P1D1, Split(), Load(), fleet()).action == "keep"
    lost = d.decide(3.0, Split(1, 0, 0), Split(), Load(), fleet())  # the decode worker died
    assert (lost.action, lost.reason, lost.target) == ("switch", "unservable", Split(0, 0, 1))
    assert candidates(0) == [] and d.decide(4.0, Split(), Split(), Load(), None).action == "keep"  # all gone


def test_workers_that_cannot_switch_keep_their_roles_in_every_split():
    assert candidates(3) == [Split(0, 0, 3), Split(1, 2, 0), Split(2, 1, 0)]
    assert candidates(3, Split(0, 1, 0)) == [Split(1, 2, 0), Split(2, 1, 0)]
    workers = [worker("a", "prefill"), worker("b", "decode", switchable=False), worker("c", "decode")]
    assert fixed_split(workers) == Split(0, 1, 0)
    decision = decider().decide(100.0, Split(1, 2, 0), fixed_split(workers), CHAT, fleet(*workers))
    assert Split(0, 0, 3) not in decision.predictions and decision.target.decode >= 1
    fixed, free = worker("f", "prefill", switchable=False), worker("s", "decode")
    assert [(w.worker_id, role) for w, role in assign([fixed, free], B2)] == [("s", "both")]


def test_the_least_loaded_workers_switch_in_an_order_that_always_serves():
    workers = [worker("w0", "prefill", running=1), worker("w1", "decode", running=5), worker("w2", "decode", running=2)]
    moves = assign(workers, Split(0, 0, 3))
    assert [(w.worker_id, role) for w, role in moves] == [("w0", "both"), ("w2", "both"), ("w1", "both")]
    moves = assign(workers, Split(2, 1, 0))  # the busier decode worker keeps its streams
    assert [(w.worker_id, role) for w, role in moves] == [("w2", "prefill")]
    both = [worker("w0", "both", running=3), worker("w1", "both", running=1)]
    moves = assign(both, P1D1)  # the prefill worker first: its pair stays `both` until then
    assert [(w.worker_id, role) for w, role in moves] == [("w1", "prefill"), ("w0", "decode")]
    roles = {w.worker_id: w.role for w in both}
    for w, role in moves:
        roles[w.worker_id] = role
        assert Split.of(roles.values()).servable


def test_a_switch_spreads_the_running_batch_over_the_new_splits_decoders():
    """1p1d -> 2b with 40 streams on the decode worker: it hands 20 over to reach its share; the
    prefill worker's in-flight prefills are no decode rows. A worker turning prefill hands all its
    streams over (it may still prefill their continuations: their pages move); a surplus under the
    minimum, a worker that does not switch, or 0 (off) hands nothing over."""
    split = [worker("w0", "prefill", running=3), worker("w1", "decode", running=40)]
    moves = assign(split, B2)
    assert hand_overs(split, moves, 8) == {"w1": 20}
    assert hand_overs(split, moves, 21) == {} and hand_overs(split, moves, 0) == {}
    both = [worker("w0", "both", running=30), worker("w1", "both", running=10)]
    moves = assign(both, P1D1)  # w1 (fewer streams) turns prefill: all 10 go to w0, now decode
    assert [(w.worker_id, role) for w, role in moves] == [("w1", "prefill"), ("w0", "decode")]
    assert hand_overs(both, moves, 8) == {"w1": 10} and hand_overs(both, moves, 11) == {}
    three = [worker("w0", "prefill"), worker("w1", "decode", running=30), worker("w2", "decode", running=6)]
    moves = assign(three, Split(0, 0, 3))  # 36 streams over three: 12 each, w1 gives 18
    assert hand_overs(three, moves, 4) == {"w1": 18}
    stays = [worker("w0", "prefill"), worker("w1", "decode", running=30), worker("w2", "decode", running=0)]
    moves = assign(stays, Split(2, 1, 0))  # w2 turns prefill with nothing to give; w1 keeps its role
    assert [(w.worker_id, role) for w, role in moves] == [("w2", "prefill")] and hand_overs(stays, moves, 1) == {}


def test_the_window_reads_counters_as_their_growth_and_a_restart_from_zero():
    def reading(at, ttft_count, ttft_sum, prompt, computed, running=2, nonce="n1", queued=0):
        gateway = {"ttft_count": ttft_count, "ttft_sum": ttft_sum, "itl_count": 10 * ttft_count,
                   "itl_sum": ttft_count * 1.0, "prompt_tokens": prompt, "output_tokens": 10 * ttft_count}
        return Reading(at, {"g": gateway}, {f"w1/{nonce}": {"prefill_tokens": computed, "decode_tokens": 0.0}},
                       (worker("w1", "decode", running=running, kv=0.25, queued=queued),))

    window = LoadWindow(seconds=10.0)
    window.add(reading(0.0, 100, 50.0, 30000, 9000))
    assert window.load() == Load()  # one reading: no rate yet
    window.add(reading(5.0, 110, 60.0, 33000, 9300, queued=6000))
    load = window.load()
    assert (load.queued_prefill_tokens, load.backlog_tokens) == (3000, 6000)  # the mean and the peak
    assert load.requests == 10 and load.requests_per_s == pytest.approx(2.0)
    assert load.prompt_tokens == pytest.approx(300) and load.uncached_tokens == pytest.approx(30)
    assert load.ttft_s == pytest.approx(1.0) and load.itl_s == pytest.approx(0.1)
    assert load.decode_streams == 2 and load.kv_live_pages == pytest.approx(100)
    window.add(reading(10.0, 120, 70.0, 36000, 250, nonce="n2"))  # the worker restarted: counts from 0
    assert window.load().computed_prompt_tokens_per_s == pytest.approx(250 / 10)
    window.add(reading(16.0, 130, 80.0, 39000, 500, nonce="n2"))  # older than 10 s: dropped
    assert window.load().seconds == pytest.approx(11.0)
    window.reset()
    assert window.load() == Load()


def test_a_burst_the_gateways_admission_holds_back_counts_in_the_backlog():
    """48 new 6k-token conversations at once: the gateway's prefill budget lets two steps' worth
    reach the workers and holds the rest in its admission queue, so the workers' queues alone show
    a fraction of the burst. Read through a real admission queue's /metrics page."""
    async def held_back() -> str:
        registry = CollectorRegistry()
        queue = AdmissionQueue(100, 100, 0.0, budget=lambda pool: Budget(prefill_tokens=16384))
        register_admission_metrics(registry, queue)
        tasks = [asyncio.create_task(queue.ticket().acquire(Work(1, 6128, 6000))) for _ in range(48)]
        await asyncio.sleep(0.05)
        text = generate_latest(registry).decode()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return text

    waiting = gateway_figures(asyncio.run(held_back()))["waiting_prompt_tokens"]
    assert waiting == 46 * 6000  # two granted (12k of the 16k budget), the rest held back

    def reading(at, prompt, computed, held=0.0, queued=0):
        gateway = {"ttft_count": at, "ttft_sum": at, "prompt_tokens": prompt, "waiting_prompt_tokens": held}
        return Reading(at, {"g": gateway}, {"w1/n": {"prefill_tokens": computed, "decode_tokens": 0.0}},
                       (worker("w1", "both", queued=queued),))

    window = LoadWindow(seconds=10.0)
    window.add(reading(0.0, 0, 0))
    window.add(reading(3.0, 12000, 12000, held=waiting, queued=12000))
    assert window.load().backlog_tokens == 12000 + waiting  # all uncached: the whole burst
    # later, cached turns held back weigh only their uncached part: of the prompts admitted up to
    # then, the share the workers computed (here a fifth)
    window.add(reading(6.0, 112000, 22400, held=100000))
    load = window.load()
    assert load.backlog_tokens == 12000 + waiting  # still the burst's reading, the peak
    assert load.queued_prefill_tokens == pytest.approx((12000 + waiting + 100000 * 0.2) / 3)


def test_under_overload_the_load_is_the_requests_that_reached_the_gateway_not_the_first_tokens():
    """A gateway's real /metrics page over 10 s: 4 requests got their first token and finished, 4
    more were turned away busy (429), 4 wait in flight and 2 were malformed (400, no load): 12
    requests reached it, three times the 4 served. One prefill worker takes ~2 s a 250-token
    prompt: 0.4 a second keep it 80% busy, 1.2 a second are past its capacity."""
    gateway = GatewayMetrics()
    before = gateway_figures(gateway.exposition().decode())
    labels = ("chat_completions", "m", "")
    for _ in range(4):
        gateway.time_to_first_token.labels(*labels).observe(2.5)
        gateway.inter_token_latency.labels(*labels).observe(0.2)
        gateway.prompt_tokens.labels(*labels).inc(250)
        gateway.generation_tokens.labels(*labels).inc(16)
        gateway.request_finished("chat_completions", 200)
        gateway.request_finished("chat_completions", 429)
        gateway.inflight.labels("chat_completions").inc()
    for _ in range(2):
        gateway.request_finished("chat_completions", 400)
    after = gateway_figures(gateway.exposition().decode())
    fleet_now = (worker("w0", "prefill"), worker("w1", "decode", running=2))
    window = LoadWindow(seconds=60.0)
    window.add(Reading(0.0, {"g": before}, {"w0/n": {"prefill_tokens": 0.0, "decode_tokens": 0.0}}, fleet_now))
    window.add(Reading(10.0, {"g": after}, {"w0/n": {"prefill_tokens": 1000.0, "decode_tokens": 0.0}}, fleet_now))
    load = window.load()
    assert load.requests_per_s == pytest.approx(0.4) and load.arrivals_per_s == pytest.approx(1.2)
    assert load.offered_per_s == pytest.approx(1.2) and load.prompt_tokens == pytest.approx(250)
    # by the first tokens alone the split looks within its TTFT target; by the arrivals it is past it
    served_only = Load(**{**load.__dict__, "arrivals_per_s": 0.0})
    f = fleet()
    assert predict(P1D1, served_only, f).ratios[0] < 1 < predict(P1D1, load, f).ratios[0]
    # the same by base model, for the planner of one model among several: the page's requests whose
    # model resolved (here none but these: 3 served, 1 turned away, 1 malformed, 2 in flight)
    for status in (200, 200, 200, 429, 400):
        gateway.request_resolved("m")
        gateway.request_finished("chat_completions", status, "m")
    for _ in range(2):
        gateway.request_resolved("m")
    page = gateway.exposition().decode()
    assert (gateway_figures(page, "m")["finished"], gateway_figures(page, "m")["inflight"]) == (4.0, 2.0)
    assert (gateway_figures(page, "other")["finished"], gateway_figures(page, "other")["inflight"]) == (0.0, 0.0)


def test_the_planner_of_a_gateways_only_model_counts_the_requests_refused_before_their_model_resolved():
    """A request turned away for want of a place (429 before its body is parsed) is no model's;
    where the gateway serves the planner's model alone (its admission pools, the waiting gauge's
    labels, say so: a Kubernetes planner always names its model) the unlabelled pair counts, those
    refusals included. Beside another model it reads its model's own pair."""
    def page(models: list[str]) -> str:
        gateway = GatewayMetrics()
        register_admission_metrics(gateway.registry, AdmissionQueue(10, 10, 0.0, pools=lambda: models))
        for _ in range(3):
            gateway.request_finished("chat_completions", 429)  # no place: refused before its model resolved
        gateway.request_resolved("m")
        gateway.request_finished("chat_completions", 200, "m")
        return gateway.exposition().decode()

    assert gateway_figures(page(["m"]), "m")["finished"] == 4.0
    assert gateway_figures(page(["m", "other"]), "m")["finished"] == 1.0
    assert gateway_figures(page(["m", "other"]), "other")["finished"] == 0.0


def _arrivals_window(per_interval: list[int], missed: tuple[int, ...] = (), prompts_each: int = 1) -> Load:
    """A window of 3 s readings of a real gateway's /metrics page: per_interval[i] requests arrive
    (and wait in flight) before reading i + 1, one request gets its first tokens each reading
    (prompts_each of them: a prompt list), and the readings in `missed` lost the gateway's scrape."""
    gateway, labels = GatewayMetrics(), ("chat_completions", "m", "")
    window = LoadWindow(seconds=60.0)
    for i, arriving in enumerate([0, *per_interval]):
        for _ in range(arriving):
            gateway.inflight.labels("chat_completions").inc()
        if i:
            for _ in range(prompts_each):
                gateway.time_to_first_token.labels(*labels).observe(1.0)
                gateway.prompt_tokens.labels(*labels).inc(250)
            gateway.generation_tokens.labels(*labels).inc(16)
        figures = {} if i in missed else {"g": gateway_figures(gateway.exposition().decode())}
        worker_figures = {"w0/n": {"prefill_tokens": 250.0 * i * prompts_each, "decode_tokens": 0.0}}
        queued = 250 * (sum(per_interval[:i]) - i)
        window.add(Reading(3.0 * i, figures, worker_figures, (worker("w0", "both", queued=queued), worker("w1", "both"))))
    return window.load()


def test_a_burst_of_arrivals_is_weighed_as_backlog_not_also_as_a_rate_the_prefill_must_keep_up_with():
    """Lockstep chats' first turns: 24 new conversations reach the gateway at once, then a request
    every 3 s. Counted over the window the burst's arrivals read 2.25 a second, far more than two
    `both` workers prefill, and the same tokens are the backlog: the hold for a burst the split
    clears within the dwell never applied (on two H200s 96 chats switched two `both` workers to the
    split under their first turns, and their cached turns ran on the split). The rate beside the
    burst is what arrives outside its reading interval. Read through a real gateway's /metrics."""
    f, burst = fleet(), _arrivals_window([24, 1, 1, 1])
    assert burst.arrivals_per_s == pytest.approx(27 / 12) and burst.offered_beside_burst_per_s == pytest.approx(3 / 9)
    assert burst.backlog_tokens == 250 * 23
    # LONG's prompts, which the split serves better than two `both` workers: the burst is held
    held_load = Load(**{**LONG.__dict__, "arrivals_per_s": burst.arrivals_per_s, "backlog_tokens": burst.backlog_tokens,
                        "arrivals_beside_burst_per_s": burst.arrivals_beside_burst_per_s})
    queued = backlog(B2, held_load, f)
    assert queued.clear_s < 60.0 and queued.busy < 0.9
    held = decider().decide(100.0, B2, Split(), held_load, f)
    assert (held.action, held.reason) == ("hold", "backlog")
    assert figures(held, f)["load.offered_beside_burst_per_s"] == pytest.approx(3 / 9, abs=1e-3)
    # counted as a rate too (before), the same burst read as an overload and switched
    as_rate = Load(**{**held_load.__dict__, "arrivals_beside_burst_per_s": None})
    assert backlog(B2, as_rate, f).busy > 0.9 and decider().decide(100.0, B2, Split(), as_rate, f).action == "switch"
    # a missed scrape joins the intervals on both sides of it: the gateway's history is not counted
    # as one interval's arrivals, nor two intervals' arrivals read as a burst in one's time
    missed = _arrivals_window([24, 1, 1, 1, 1], missed=(3,))
    assert missed.offered_beside_burst_per_s == pytest.approx(missed.offered_per_s * (4 / 12) / (28 / 15))
    assert _arrivals_window([7, 7, 7, 7, 7], missed=(3,)).arrivals_beside_burst_per_s is None
    # a prompt list is one arrival and several first tokens: the offered rate counts the first
    # tokens where they outnumber the arrivals, and the rate beside the burst is its share of it
    lists = _arrivals_window([24, 1, 1, 1], prompts_each=16)
    assert lists.offered_per_s == lists.requests_per_s == pytest.approx(64 / 12) and lists.requests_per_s > lists.arrivals_per_s
    assert lists.offered_beside_burst_per_s == pytest.approx(lists.offered_per_s * (3 / 9) / (27 / 12))


@pytest.mark.parametrize("per_interval", [[7, 7, 7, 6], [9, 6, 7, 5], [12, 5, 6]])
def test_arrivals_that_vary_as_random_ones_do_are_a_rate_not_a_burst(per_interval):
    """Steady arrivals always have a busiest interval; setting it aside would read an overload as
    lighter than it is and hold the split it overloads. Only an interval past twice the others'
    rate, and past it by three standard deviations of a Poisson count, is a burst."""
    load = _arrivals_window(per_interval)
    assert load.arrivals_beside_burst_per_s is None
    assert load.offered_beside_burst_per_s == load.offered_per_s == pytest.approx(sum(per_interval) / (3 * len(per_interval)))
    overload = Load(**{**LONG.__dict__, "arrivals_per_s": load.arrivals_per_s, "backlog_tokens": 2000.0,
                       "arrivals_beside_burst_per_s": load.arrivals_beside_burst_per_s})
    assert backlog(B2, overload, fleet()).busy > 0.9 and decider().decide(100.0, B2, Split(), overload, fleet()).action == "switch"


def test_a_window_too_short_to_tell_a_burst_or_without_arrivals_keeps_the_offered_rate():
    assert _arrivals_window([24, 1]).arrivals_beside_burst_per_s is None  # two intervals
    silent = _arrivals_window([24, 1, 1, 1], missed=(1, 2, 3, 4))  # the gateway never answered after the first
    assert silent.arrivals_beside_burst_per_s is None and silent.offered_beside_burst_per_s == silent.offered_per_s


def test_predictions_are_corrected_by_what_the_gateways_saw():
    f = fleet()
    seen = Load(**{**CHAT.__dict__, "ttft_s": 10.0, "itl_s": 0.05})
    corr = Corrections.of(P1D1, seen, f)
    plain = predict(P1D1, seen, f)
    assert corr.ttft == 4.0  # clamped: at most 4x
    assert corr.itl == pytest.approx(max(0.25, 0.05 / plain.itl_s))
    assert predict(B2, seen, f, corr).ttft_s == pytest.approx(predict(B2, seen, f).ttft_s * corr.ttft)
    assert math.isinf(predict(Split(1, 0, 0), seen, f).score)  # a prefill worker alone serves nothing


def test_a_pool_grows_where_a_target_is_missed_and_shrinks_with_headroom_to_spare():
    f, room = fleet(ttft_s=5.0), {"prefill": (1, 1, 4), "decode": (1, 1, 4)}
    prompts = pool_step(2, long_prompts(1.2, 2.0), f, Corrections(), 0.2, room)  # prefill past its capacity
    assert (prompts.pool, prompts.delta, prompts.reason, prompts.prediction.split) == ("prefill", 1, "slo", Split(2, 1))
    streams = pool_step(2, long_prompts(0.6, 6.0), f, Corrections(), 0.2, room)  # six streams on one decode worker
    assert (streams.pool, streams.delta, streams.prediction.split) == ("decode", 1, Split(1, 2))
    full = {"prefill": (4, 1, 4), "decode": (1, 1, 4)}  # the prefill pool at its bound: the other one grows
    assert pool_step(2, long_prompts(1.2, 2.0), f, Corrections(), 0.2, full).pool == "decode"
    assert pool_step(2, long_prompts(0.4, 1.0), f, Corrections(), 0.2, room) is None  # within the targets
    light = long_prompts(0.05, 0.3)
    fewer = pool_step(3, light, f, Corrections(), 0.2, {"prefill": (1, 1, 4), "decode": (2, 1, 4)})
    assert (fewer.pool, fewer.delta, fewer.reason) == ("decode", -1, "headroom")
    assert pool_step(3, light, f, Corrections(), 0.2, {"prefill": (1, 1, 4), "decode": (2, 2, 4)}) is None  # bounds
    # each candidate by its way's correction factors: the split's own, not those seen beside decode rows
    fine = pool_step(2, long_prompts(0.4, 1.0), f, Corrections(4.0, 4.0), 0.2, room,
                     {SPLIT: Corrections(), BESIDE: Corrections(4.0, 4.0)})
    assert fine is None and pool_step(2, long_prompts(0.4, 1.0), f, Corrections(4.0, 4.0), 0.2, room) is not None
    other = pool_step(3, light, f, Corrections(), 0.2, {"prefill": (2, 1, 4), "decode": (1, 1, 4)})
    assert (other.pool, other.delta) == ("prefill", -1)


def test_the_ttft_target_defaults_by_device_and_the_itl_target_to_the_workers():
    from shared.perf_model.config import TtftTarget
    assert TtftTarget().target_s(on_gpu=True) == 1.0 and TtftTarget().target_s(on_gpu=False) == 5.0
    assert TtftTarget(250.0).target_s(on_gpu=True) == 0.25
    f = Fleet.of([worker("w0", "decode")], 1.0, 0.0)
    assert f.itl_target_s == 0.25 and Fleet.of([worker("w0", "decode")], 1.0, 0.05).itl_target_s == 0.05


def test_correction_factors_are_kept_by_the_way_a_split_serves_the_load():
    f = fleet()
    assert (way(P1D1, LONG), way(B2, LONG), way(P1D1, CHAT)) == (SPLIT, BESIDE, BESIDE)  # chat: local prefill
    # two `both` workers under long prompts, the gateways seeing 4x the first-token wait and 2x
    # the inter-token latency they were predicted: the chunks beside the decode rows
    raw = predict(B2, LONG, f)
    seen = Load(**{**LONG.__dict__, "ttft_s": raw.ttft_s * 4, "itl_s": raw.itl_s * 2})
    d = decider(min_requests=1)
    on_b2 = d.decide(100.0, B2, Split(), seen, f)
    assert (on_b2.corrections.ttft, on_b2.corrections.itl) == (pytest.approx(4.0), pytest.approx(2.0))
    assert on_b2.prediction(B2).ttft_s == pytest.approx(raw.ttft_s * 4)
    # the split serves the load another way, not seen yet: halfway (2x and 1.41x), not the same 4x and 2x
    split = predict(P1D1, seen, f)
    assert on_b2.prediction(P1D1).ttft_s == pytest.approx(split.ttft_s * 2.0)
    assert on_b2.prediction(P1D1).itl_s == pytest.approx(split.itl_s * math.sqrt(2.0))
    # once the split served it (its own factors: as predicted), two `both` workers are predicted by
    # what was seen of them, for as long as the memory keeps it
    as_predicted = Load(**{**LONG.__dict__, "ttft_s": split.ttft_s, "itl_s": split.itl_s})
    on_split = d.decide(130.0, P1D1, Split(), as_predicted, f)
    assert on_split.corrections.ttft == pytest.approx(1.0)
    assert on_split.prediction(B2).ttft_s == pytest.approx(predict(B2, as_predicted, f).ttft_s * 4)
    assert on_split.by_way[BESIDE].ttft == pytest.approx(4.0) and on_split.by_way[SPLIT].ttft == pytest.approx(1.0)
    shown = figures(on_split, f)  # the log line's and the span event's figures: each way's factors
    assert (shown["correction.beside.ttft"], shown["correction.split.ttft"]) == (4.0, 1.0)
    # neither an idle window nor a burst's readings stand for a way in the memory
    quiet = decider(min_requests=1000)
    quiet.decide(100.0, B2, Split(), seen, f)
    assert quiet.memory.seen == {}
    burst = Load(**{**seen.__dict__, "backlog_tokens": 2000.0})
    assert quiet.clears_within_dwell(backlog(B2, burst, f), f)
    bursting = decider(min_requests=1)
    bursting.decide(100.0, B2, Split(), burst, f)
    assert bursting.memory.seen == {}
    memory = CorrectionMemory(memory_s=60.0)
    memory.note(BESIDE, Corrections(4.0, 2.0), 100.0)
    assert memory.for_way(BESIDE, SPLIT, Corrections(1.0, 1.0), 150.0) == Corrections(4.0, 2.0)
    assert memory.for_way(BESIDE, SPLIT, Corrections(1.0, 9.0), 170.0) == Corrections(1.0, 3.0)  # forgotten
    assert memory.for_way(SPLIT, SPLIT, Corrections(1.5, 1.0), 170.0) == Corrections(1.5, 1.0)


def test_a_split_is_predicted_by_the_model_of_steps_that_carry_prompts_alone():
    """Two `both` workers fit their models to mixed steps; the split they could become runs a
    prefill worker's steps, prompts alone, which their published prefill_step models price."""
    plain = [worker("w0", "both"), worker("w1", "both")]
    base = plain[0].perf.step
    # prompts alone cost a third of what the mixed-step model says a token (its decode terms,
    # never fitted there, are off tenfold: a split's decode steps are not predicted by them)
    alone = StepModel((base.coef[0], base.coef[1] / 3, base.coef[2] / 3, base.coef[3] * 10, base.coef[4] * 10),
                      samples=50)
    fewer = replace(alone, coef=tuple(c * 2 for c in alone.coef), samples=10)
    published = [worker("w0", "both"), worker("w1", "both")]
    for w, model in zip(published, (fewer, alone)):
        w.perf = replace(w.perf, prefill_step=model)
    f_plain, f_alone = fleet(*plain), fleet(*published)
    assert f_plain.prefill_alone is f_plain.model and f_alone.prefill_alone == alone  # the most samples
    load = long_prompts(1.2, 2.0)  # past one prefill worker's capacity by the mixed-step model
    assert predict(P1D1, load, f_alone).ttft_s < predict(P1D1, load, f_plain).ttft_s / 2  # the best-fitted one
    assert predict(P1D1, load, f_alone).itl_s == pytest.approx(predict(P1D1, load, f_plain).itl_s)
    assert backlog(B2, Load(**{**load.__dict__, "backlog_tokens": 5000.0}), f_alone) == \
        backlog(B2, Load(**{**load.__dict__, "backlog_tokens": 5000.0}), f_plain)
    # two `both` workers prefill beside their rows: the mixed-step model, as before
    assert predict(B2, load, f_alone).ttft_s == pytest.approx(predict(B2, load, f_plain).ttft_s)
    assert backlog(P1D1, Load(**{**load.__dict__, "backlog_tokens": 5000.0}), f_alone).clear_s < \
        backlog(P1D1, Load(**{**load.__dict__, "backlog_tokens": 5000.0}), f_plain).clear_s
