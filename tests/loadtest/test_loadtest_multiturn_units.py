"""The multi-turn load generator's parts on their own: conversation builders, the history
fed back, the context limit, arrival schedules, the lockstep barrier, per-turn metrics,
result files, tables and plots."""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time

import pytest

from loadtest.config import EndpointConfig
from loadtest.multiturn.agentic_sessions import AgenticShape, agentic_dialogs
from loadtest.multiturn.cli import config_from, multiturn_parser
from loadtest.multiturn.dialog import CONTEXT_LIMIT, ERROR, FINISHED, TIME_UP, Dialog, DialogState, TurnSpec
from loadtest.multiturn.driver import TurnSender, run_lockstep, run_staggered
from loadtest.multiturn.plots import plot_ttft_by_turn
from loadtest.multiturn.report_text import render_comparison, render_turn_table
from loadtest.multiturn.results_io import MultiTurnResult, read_result, write_result
from loadtest.multiturn.sharegpt_dialogs import ShareGPTLimits, normalize, sample_sharegpt_dialogs
from loadtest.multiturn.synthetic_dialogs import SyntheticShape, synthetic_dialogs
from loadtest.multiturn.timing import DialogTiming, ThinkTime, plan_timing
from loadtest.multiturn.turn_metrics import summarize_multiturn
from loadtest.multiturn.turn_record import DialogOutcome, TurnRecord
from loadtest.records import RequestRecord
from loadtest.tokenizer_source import TokenCounter, load_tokenizer
from loadtest.workloads.sharegpt import read_items
from loadtest.workloads.synthetic_text import SyntheticText

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(load_tokenizer(None))  # Duet's default model


@pytest.fixture(scope="module")
def text(counter) -> SyntheticText:
    return SyntheticText(counter, random.Random(3))


# --- conversations and their history -------------------------------------------------------

def test_each_turn_sends_the_history_with_the_models_answers():
    plan = Dialog(0, [{"role": "system", "content": "S"}], [TurnSpec(5, user="q0"), TurnSpec(6, user="q1"),
                                                           TurnSpec(7, user="q2")])
    state = DialogState.start(plan)
    assert state.request_messages() == [{"role": "system", "content": "S"}, {"role": "user", "content": "q0"}]
    assert state.spec.output_len == 5
    state.accept("answer zero")
    assert state.turn == 1 and state.active
    assert state.request_messages() == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "answer zero"}, {"role": "user", "content": "q1"}]
    state.accept("answer one")
    assert [m["content"] for m in state.request_messages()] == ["S", "q0", "answer zero", "q1", "answer one", "q2"]
    state.accept("answer two")
    assert state.ended == FINISHED and not state.active
    assert plan.opening == [{"role": "system", "content": "S"}]  # the plan is never changed
    state.end(ERROR)
    assert state.ended == FINISHED  # the first reason stays


def test_sharegpt_turns_normalized_like_a_chat_client_sends_them():
    turns = [{"from": "gpt", "value": "stray opener"}, {"from": "system", "value": "be brief"},
             {"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"},
             {"from": "system", "value": "mid-dialog"}, {"from": "user", "value": "d"},
             {"from": "chatgpt", "value": "e"}, {"from": "bing", "value": "f"},
             {"from": "human", "value": "  "}, {"from": "gpt", "value": "g"}]
    d = normalize(turns)
    assert d.system == "be brief"  # a system turn before the first user turn; the later one is dropped
    assert [(e.user, e.reply) for e in d.exchanges] == [("a\n\nb", "c"), ("d", "e\n\nf")]  # stops at the blank turn
    d = normalize([{"from": "system", "value": "be brief"}, {"from": "human", "value": "x"},
                   {"from": "gpt", "value": "y"}, {"from": "human", "value": "unanswered"}])
    assert d.system == "be brief" and [(e.user, e.reply) for e in d.exchanges] == [("x", "y")]


def test_packaged_sharegpt_dialogs_turn_counts_output_lengths_and_context_bound(counter):
    items = list(read_items())
    assert 17_500 < len(items) < 17_800  # the packaged file is cut off; whole elements only
    limits = ShareGPTLimits(min_turns=3, max_turns=4, max_context_tokens=1024)
    dialogs = sample_sharegpt_dialogs(items, 12, counter, random.Random(0), limits)
    assert [d.id for d in dialogs] == list(range(12))
    for d in dialogs:
        assert 3 <= len(d.turns) <= 4 and all(t.user for t in d.turns)
        first = counter.prompt_tokens(d.opening + [{"role": "user", "content": d.turns[0].user}], None)
        assert first + d.turns[0].output_len <= 1024
    # Output lengths are the dataset replies' token counts, unless fixed or capped.
    by_user = {}
    for item in items:
        for e in normalize(item.get("conversations") or []).exchanges:
            by_user.setdefault(e.user, e.reply)
    t = dialogs[0].turns[0]
    assert t.output_len == max(1, counter.text_tokens(by_user[t.user]))
    fixed = sample_sharegpt_dialogs(items, 3, counter, random.Random(0), ShareGPTLimits(fixed_output_len=9))
    assert {t.output_len for d in fixed for t in d.turns} == {9}
    capped = sample_sharegpt_dialogs(items, 5, counter, random.Random(0), ShareGPTLimits(max_output_len=20))
    assert max(t.output_len for d in capped for t in d.turns) <= 20
    # Same seed, same conversations.
    again = sample_sharegpt_dialogs(items, 12, counter, random.Random(0), limits)
    assert [d.turns[0].user for d in again] == [d.turns[0].user for d in dialogs]


def test_synthetic_conversations_have_their_own_exact_length_system_prompts(counter, text):
    dialogs = synthetic_dialogs(SyntheticShape(conversations=3, system_len=300, turns=4, user_len=20,
                                               output_len=48), text)
    systems = [d.opening[0]["content"] for d in dialogs]
    assert len(set(systems)) == 3 and all(counter.text_tokens(s) == 300 for s in systems)
    for d in dialogs:
        assert len(d.turns) == 4 and d.tools is None
        assert all(t.output_len == 48 and counter.text_tokens(t.user) == 20 for t in d.turns)


def test_agentic_sessions_share_prefix_and_tools_and_stay_well_formed(counter, text):
    shape = AgenticShape(sessions=3, system_len=150, num_tools=12, turns=5, task_len=16, tool_output_len=100,
                         output_len=32)
    dialogs = agentic_dialogs(shape, text, random.Random(1))
    assert len({json.dumps(d.opening) for d in dialogs}) == 1  # one shared system prompt
    assert len({json.dumps(d.tools) for d in dialogs}) == 1
    names = [t["function"]["name"] for t in dialogs[0].tools]
    assert len(names) == 12 == len(set(names))  # past the ten defined, numbered copies
    for d in dialogs:
        assert d.turns[0].user.startswith("Task: ") and d.turns[0].tool_result is None
        for t in d.turns[1:]:
            assert t.user is None and 50 <= counter.text_tokens(t.tool_result) <= 150
            fn = next(x["function"] for x in d.tools if x["function"]["name"] == t.tool_call["function"]["name"])
            args = json.loads(t.tool_call["function"]["arguments"])
            assert set(fn["parameters"]["required"]) <= set(args) <= set(fn["parameters"]["properties"])
    # Played through: every tool message answers the call on the assistant message before it.
    state = DialogState.start(dialogs[0])
    for k in range(4):
        state.accept(f"step {k}")
    msgs = state.request_messages()
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * 4
    for a, t in zip(msgs[2::2], msgs[3::2]):
        assert a["tool_calls"][0]["id"] == t["tool_call_id"]
    assert [m["content"] for m in msgs[2::2]] == [f"step {k}" for k in range(4)]
    # With tools, a template that ignores them (SmolLM2's) is charged their JSON, as servers inject it.
    plain = counter.prompt_tokens(msgs, None)
    assert counter.prompt_tokens(msgs, None, dialogs[0].tools) > plain


# --- schedules ----------------------------------------------------------------------------

def test_think_times_have_their_means_and_schedules_are_values():
    rng = random.Random(2)
    for dist in ("exponential", "uniform", "lognormal"):
        draws = [ThinkTime(2.0, dist).draw(rng) for _ in range(40_000)]
        assert statistics.fmean(draws) == pytest.approx(2.0, rel=0.04) and min(draws) >= 0
    exp = [ThinkTime(2.0).draw(rng) for _ in range(40_000)]
    assert statistics.pstdev(exp) == pytest.approx(2.0, rel=0.05)  # exponential: sd = mean
    assert ThinkTime(1.5, "constant").draw(rng) == 1.5 and ThinkTime(0.0).draw(rng) == 0.0
    with pytest.raises(ValueError):
        ThinkTime(1.0, "gauss")

    timings = plan_timing([3, 1, 5] * 2000, rate=4.0, burstiness=1.0, think=ThinkTime(0.5), rng=random.Random(7))
    starts = [t.start_at for t in timings]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert statistics.fmean(b - a for a, b in zip(starts, starts[1:])) == pytest.approx(0.25, rel=0.05)
    assert [len(t.think_s) for t in timings[:3]] == [2, 0, 4]
    again = plan_timing([3, 1, 5] * 2000, 4.0, 1.0, ThinkTime(0.5), random.Random(7))
    assert again == timings
    assert {t.start_at for t in plan_timing([2, 2], math.inf, 1.0, ThinkTime(0.5), random.Random(0))} == {0.0}


class TimedSender(TurnSender):
    """The real TurnSender's prepare (tokenizer, context limit); sending is a timed sleep
    that answers `c<conversation>t<turn>`, so schedules are checked without a server."""

    def __init__(self, counter, delays: dict[int, float], fail: set[tuple[int, int]] = frozenset(), **kw):
        t0 = time.perf_counter()
        super().__init__(None, "", EndpointConfig("http://x"), "m", counter, lambda: time.perf_counter() - t0, **kw)
        self.delays, self.fail, self.log = delays, fail, []

    async def send(self, state, prepared, scheduled_at):
        rec = RequestRecord(len(self.records), scheduled_at, prepared.prompt_len, prepared.max_tokens,
                            sent_at=self.clock())
        turn = TurnRecord(state.plan.id, state.turn, rec, prepared.body["messages"])
        self.records.append(turn)
        await asyncio.sleep(self.delays[state.plan.id])
        rec.done_at = rec.first_token_at = self.clock()
        rec.ok = (state.plan.id, state.turn) not in self.fail
        if rec.ok:
            state.accept(f"c{state.plan.id}t{state.turn}")
        else:
            rec.error_kind = "http_429"
            state.end(ERROR)
        return turn


def _dialogs(n: int, turns: int) -> list[DialogState]:
    return [DialogState.start(Dialog(i, [], [TurnSpec(4, user=f"u{i}.{t}") for t in range(turns)]))
            for i in range(n)]


def test_lockstep_waits_for_every_turn_before_the_next_and_feeds_answers_back(counter):
    states = _dialogs(3, 3)
    sender = TimedSender(counter, {0: 0.01, 1: 0.08, 2: 0.03}, fail={(2, 1)})
    asyncio.run(run_lockstep(sender, states))
    by = {(r.conversation, r.turn): r for r in sender.records}
    assert sorted(by) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    for t in (1, 2):
        starts = [r.request.sent_at for k, r in by.items() if k[1] == t]
        ends = [r.request.done_at for k, r in by.items() if k[1] == t - 1]
        assert min(starts) >= max(ends)  # the barrier: the slowest of turn t-1 gates all of turn t
        assert len({r.request.scheduled_at for k, r in by.items() if k[1] == t}) == 1  # one release time
    for (c, t), r in by.items():  # turn t's prompt carries every earlier answer of its conversation
        answers = [m["content"] for m in r.messages if m["role"] == "assistant"]
        assert answers == [f"c{c}t{k}" for k in range(t)]
    assert [s.ended for s in states] == [FINISHED, FINISHED, ERROR]  # the 429 ended conversation 2


def test_staggered_starts_and_think_times_are_kept(counter):
    states = _dialogs(2, 3)
    timings = [DialogTiming(0.0, [0.15, 0.05]), DialogTiming(0.1, [0.0, 0.2])]
    sender = TimedSender(counter, {0: 0.02, 1: 0.02})
    asyncio.run(run_staggered(sender, states, timings))
    by = {(r.conversation, r.turn): r.request for r in sender.records}
    assert len(by) == 6 and all(s.ended == FINISHED for s in states)
    assert by[(1, 0)].sent_at >= 0.1
    for c, timing in enumerate(timings):
        for t, think in enumerate(timing.think_s):
            gap = by[(c, t + 1)].sent_at - by[(c, t)].done_at
            assert think - 0.005 <= gap < think + 0.1
            assert by[(c, t + 1)].scheduled_at == pytest.approx(by[(c, t)].done_at + think)
    # A duration bound: nothing is sent at or after it.
    states = _dialogs(2, 3)
    sender = TimedSender(counter, {0: 0.02, 1: 0.02})
    asyncio.run(run_staggered(sender, states, [DialogTiming(0.0, [0.3, 0.3]), DialogTiming(0.5, [0.0, 0.0])],
                              duration_s=0.2))
    assert [(r.conversation, r.turn) for r in sender.records] == [(0, 0)]
    assert [s.ended for s in states] == [TIME_UP, TIME_UP]


def test_context_limit_stops_a_conversation_before_it_would_pass(counter, text):
    plan = Dialog(0, [{"role": "system", "content": text.text(100)}],
                  [TurnSpec(30, user=text.text(40)) for _ in range(6)])
    state = DialogState.start(plan)
    sizes = []
    limit = 400
    sender = TimedSender(counter, {0: 0.0}, max_context_tokens=limit)
    while (prepared := sender.prepare(state)) is not None:
        sizes.append(prepared.prompt_len)
        assert prepared.body["max_tokens"] == 30 and prepared.body["stream_options"] == {"include_usage": True}
        state.accept(text.text(30))
    assert state.ended == CONTEXT_LIMIT and 2 <= len(sizes) < 6
    assert all(s + 30 <= limit for s in sizes)
    assert counter.prompt_tokens(state.request_messages(), None) + 30 > limit  # the next one would not fit
    assert sizes == sorted(sizes) and sizes[1] - sizes[0] >= 70  # each turn adds answer + question


def test_agentic_requests_carry_tools_and_tool_choice_none(counter, text):
    (plan,) = agentic_dialogs(AgenticShape(sessions=1, system_len=20, num_tools=3, turns=2, task_len=5,
                                           tool_output_len=10, output_len=4), text, random.Random(0))
    sender = TimedSender(counter, {0: 0.0})
    body = sender.prepare(DialogState.start(plan)).body
    assert body["tool_choice"] == "none" and body["tools"] == plan.tools
    sender.endpoint = EndpointConfig("http://x", extra_body={"tool_choice": "auto"})
    assert sender.prepare(DialogState.start(plan)).body["tool_choice"] == "auto"


# --- metrics, files, tables, plots ---------------------------------------------------------

def _turn(conv, turn, sent, ttft, ok=True, prompt=100, cached=None, kind=None):
    rec = RequestRecord(0, sent, prompt, 4, sent_at=sent, first_token_at=sent + ttft if ok else None,
                        chunk_times=[sent + ttft + 0.01 * k for k in range(4)] if ok else [],
                        done_at=sent + ttft + 0.03 if ok else sent + 0.001, ok=ok, error_kind=kind,
                        usage_prompt_tokens=prompt if ok else None, usage_completion_tokens=4 if ok else None,
                        usage_cached_tokens=cached if ok else None)
    return TurnRecord(conv, turn, rec)


def _result(scale: float, label: str) -> MultiTurnResult:
    turns = []
    for c in range(10):
        turns.append(_turn(c, 0, 0.0, scale * 0.1 * (c + 1), prompt=100, cached=0))
        turns.append(_turn(c, 1, 2.0, scale * 0.01 * (c + 1), prompt=200, cached=96))
    turns += [_turn(10, 0, 0.0, 0, ok=False, kind="http_429"), _turn(11, 0, 0.0, 0, ok=False, kind="timeout")]
    outcomes = [DialogOutcome(c, 2, 2, FINISHED) for c in range(10)] + [DialogOutcome(c, 2, 1, ERROR)
                                                                         for c in (10, 11)]
    return MultiTurnResult(None, {"label": label, "title": f"run {label}", "conversation_rate": "inf"}, turns,
                           outcomes)


def test_by_turn_summary_table_files_and_comparison(tmp_path):
    s = summarize_multiturn("a", math.inf, _result(1.0, "a").turns, _result(1.0, "a").outcomes)
    t0, t1 = s.by_turn
    assert (t0.turn, t0.requests, t0.completed, t0.failed, t0.http_429) == (0, 12, 10, 2, 1)
    assert t0.errors == {"http_429": 1, "timeout": 1}
    assert t0.ttft.p50 == pytest.approx(550) and t1.ttft.p50 == pytest.approx(55)
    assert t0.ttft.p90 == pytest.approx(910) and t1.ttft.p99 == pytest.approx(99.1)
    assert t0.cache.share == 0.0 and t1.cache.share == pytest.approx(0.48)
    assert t0.prompt_tokens_mean == 100 and t1.prompt_tokens_mean == 200
    assert s.all_turns.cache.share == pytest.approx(960 / 3000) and s.all_turns.requests == 22
    assert s.conversations == {FINISHED: 10, ERROR: 2} and s.turns_per_conversation == pytest.approx(22 / 12)
    assert s.overall.completed == 20 and s.overall.errors == {"http_429": 1, "timeout": 1}

    table = render_turn_table(s, "title")
    lines = {line.split()[0]: line for line in table.splitlines() if line[:4].strip() in ("0", "1", "all")}
    assert lines["0"].split()[:6] == ["0", "12", "10", "1", "100", "0.0"] and lines["1"].split()[5] == "48.0"
    assert lines["0"].endswith("http_429 1, timeout 1") and lines["1"].endswith("-")
    assert "Conversations: 12 (error 2, finished 10)" in table

    a, b = _result(1.0, "colocated"), _result(0.5, "split")
    for r, name in ((a, "a"), (b, "b")):
        write_result(tmp_path / name / "results.json", r, r.summary())
    ra, rb = read_result(tmp_path / "a" / "results.json"), read_result(tmp_path / "b" / "results.json")
    assert [t.to_json() for t in ra.turns] == [t.to_json() for t in a.turns] and ra.outcomes == a.outcomes
    assert ra.summary().to_json() == a.summary().to_json()
    text = render_comparison([(ra.name, ra.summary()), (rb.name, rb.summary())])
    p50 = text.split("TTFT p50 (ms)")[1].split("TTFT p90")[0]
    assert [line.split() for line in p50.splitlines() if line[:4].strip() == "0"] == [["0", "550.0", "275.0"]]
    assert "Cached share of prompt tokens (%)" in text and "2 (1)" in text
    png = plot_ttft_by_turn([(ra.name, ra.summary()), (rb.name, rb.summary())], tmp_path / "cmp.png", "x")
    assert png.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit, match="not a duet loadtest multiturn"):
        (tmp_path / "other.json").write_text('{"format": "duet-loadtest-results/1"}')
        read_result(tmp_path / "other.json")


def test_flags_fill_each_workloads_defaults():
    cfg = config_from(multiturn_parser().parse_args(["--workload", "synthetic", "-n", "8"]))
    w, a = cfg.workload, cfg.arrivals
    assert (w.conversations, w.max_turns, w.system_len, w.output_len, a.mode) == (8, 4, 5900, 48, "lockstep")
    cfg = config_from(multiturn_parser().parse_args(["--workload", "agentic", "-r", "2", "--think-time", "3",
                                                     "--think-time-dist", "uniform"]))
    assert (cfg.workload.max_turns, cfg.workload.system_len, cfg.arrivals.mode) == (8, 2000, "poisson")
    assert cfg.arrivals.conversation_rate == 2.0 and cfg.arrivals.think_time == ThinkTime(3.0, "uniform")
    cfg = config_from(multiturn_parser().parse_args(["--mode", "lockstep", "--max-turns", "5", "--api-key", "sk-x"]))
    assert cfg.workload.name == "sharegpt" and cfg.workload.max_turns == 5 and cfg.workload.output_len is None
    assert cfg.arrivals.mode == "lockstep" and "sk-x" not in json.dumps(cfg.to_json())
    with pytest.raises(SystemExit):
        config_from(multiturn_parser().parse_args(["--conversations", "0"]))
