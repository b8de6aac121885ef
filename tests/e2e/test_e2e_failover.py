"""Failover the client never sees, end to end (services/gateway/backends/migration.py):
`duet up` with two prefill and two decode workers (its own redis-server, the router and
workers over gRPC, KV moved by NIXL/UCX, the gateway on uvicorn, the official openai
client). One stack serves both tests.

- 32 concurrent chat streams of every kind the failover must keep right (greedy, seeded at
  temperature 1, JSON-schema constrained, n = 2, logprobs with alternatives, a forced tool call
  streamed as tool-call deltas) run once unfaulted, then again while the decode worker serving
  about half of them (the tool call among them) is SIGKILLed mid stream: every stream ends with
  [DONE] and no error, and each one's choices (text, tool calls, finish reason, token logprobs)
  and usage equal the unfaulted run's. The gateway's metrics say the streams moved, and that the
  KV rebuilt for them was mostly moved from a prefill worker's cache or held by the new decode
  worker, not recomputed. Afterwards no worker holds a page or a request.
- A chaos run: under steady load (client threads looping greedy and seeded streams), a worker
  drawn at random (seeded; both roles at least once) is SIGKILLed, `duet up` restarts it, and
  once it is back in the registry and a few seconds more have passed the next one is killed:
  no request fails, every answer to one request body equals every other answer to it, and at
  the end every worker is idle with every page of both tiers free or cached, the router's load
  account is empty, the registry holds exactly the live workers, and the gateway's memory is
  flat (RSS after a warm-up and at the end).

Each test prints a one-line summary (pytest -s)."""
from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest

from tests.helpers.stack import DuetUp, child_process, managed, new_log_dir, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 16
STREAMS = 32  # the tool call and 31 questions
MIN_ON_VICTIM = 8  # streams the killed decode worker runs at least (about half of them, spread by load)
PREFILL, DECODE = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")
WORKERS = PREFILL + DECODE
# a long shared system prompt: the prefill worker keeps its pages, so a moved stream's KV is
# mostly moved from there rather than computed again
SYSTEM = ("You are a patient tutor for a class of curious twelve-year-olds. You explain one idea at a time, "
          "in plain words, with one concrete everyday example, and you never use jargon without saying what "
          "it means. When a question has a short factual answer you give it first and then explain why. "
          "You keep every answer under a hundred words, you do not use lists or headings, and you end with "
          "one short question that checks the student understood. You are friendly but never silly, and "
          "you always stay on the topic the student asked about.")
TOPICS = ["the blue sky", "honey bees", "rainbows", "the seasons", "a compass", "floating ice", "shadows",
          "plant roots", "salty seas", "bicycles", "echoes", "purring cats", "volcanoes", "thunder", "magnets",
          "snowflakes", "fossils", "clouds", "batteries", "spider webs", "hot air balloons"]
TEMPLATES = ["What is one surprising fact about {}?", "How would you explain {} to a younger child?",
             "Why do scientists study {}?"]
QUESTIONS = [t.format(topic) for t in TEMPLATES for topic in TOPICS][:STREAMS - 1]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}


# several arguments of fixed phrases (about 95 tokens in all), so the call still streams when the
# others are a few tokens in (it is placed first and alone, and outlasts them), and always ends
# within max_tokens (enums compile fast; a length bound would not)
_MOON = ("the moon reflects the light of the sun, so we see more or less of its sunlit half as it goes "
         "around the earth")
_TIDES = "the pull of the moon lifts the oceans a little, so every coast passes two bulges of water each day"
_CHECK = "if the moon were twice as far away, would the tides be bigger or smaller, and why"
NOTE_FIELDS = {
    "explanation": [_MOON, _TIDES],
    "example": [_TIDES, _MOON],
    "question": [_CHECK, _CHECK.replace("twice as far away", "half as far away")],
}
NOTE_TOOL = {"type": "function", "function": {
    "name": "write_note", "description": "Write a short note for the class.",
    "parameters": {"type": "object", "properties": {k: {"enum": v} for k, v in NOTE_FIELDS.items()},
                   "required": list(NOTE_FIELDS), "additionalProperties": False}}}
TOOL_CASE = len(QUESTIONS)  # its index in cases()
TOOL_MAX_TOKENS = 160  # room for the ~95 the grammar ends it at


def cases() -> list[dict]:
    """Per stream, the request's arguments: the five kinds in turn over the questions, then the
    tool call."""
    kinds = [dict(temperature=0),
             dict(temperature=1.0, seed=1234),
             dict(temperature=1.0, seed=77, response_format={"type": "json_schema", "json_schema": {
                 "name": "answer", "schema": SCHEMA, "strict": True}}),
             dict(temperature=1.0, seed=4321, n=2),
             dict(temperature=0, logprobs=True, top_logprobs=2)]
    out = []
    for i, question in enumerate(QUESTIONS):
        kw = dict(kinds[i % len(kinds)])
        if "response_format" not in kw:
            kw["extra_body"] = {"ignore_eos": True}  # every stream runs its whole length
        # a JSON answer ends itself (room for its ~16 tokens, so most stop)
        limit = 2 * MAX_TOKENS if "response_format" in kw else MAX_TOKENS
        out.append(dict(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                        max_tokens=limit, **kw))
    # a forced tool call (the grammar ends it), its arguments streamed as tool-call deltas
    out.append(dict(messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Write a note for the class about the moon."}],
                    max_tokens=TOOL_MAX_TOKENS, temperature=0, tools=[NOTE_TOOL],
                    tool_choice={"type": "function", "function": {"name": "write_note"}}))
    return out


@dataclass
class Stream:
    """One streamed chat completion: what the client saw."""

    texts: dict[int, str] = field(default_factory=dict)
    tool_calls: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (choice, call) -> [name, arguments]
    reasons: dict[int, str] = field(default_factory=dict)
    logprobs: list[tuple[str, float, list[str]]] = field(default_factory=list)
    usage: object = None
    id: str = ""  # the completion's id: the gateway's request id
    chunks: int = 0
    error: BaseException | None = None

    def run(self, client, case: dict) -> None:
        try:
            for chunk in client.chat.completions.create(model=MODEL, stream=True,
                                                        stream_options={"include_usage": True}, **case):
                self.usage = chunk.usage or self.usage
                self.id = chunk.id
                for choice in chunk.choices:
                    self.chunks += 1
                    self.texts[choice.index] = self.texts.get(choice.index, "") + (choice.delta.content or "")
                    for call in choice.delta.tool_calls or []:
                        seen = self.tool_calls.setdefault((choice.index, call.index), ["", ""])
                        seen[0] += (call.function.name or "") if call.function else ""
                        seen[1] += (call.function.arguments or "") if call.function else ""
                    if choice.finish_reason:
                        self.reasons[choice.index] = choice.finish_reason
                    for lp in (choice.logprobs.content or []) if choice.logprobs else []:
                        self.logprobs.append((lp.token, lp.logprob, [t.token for t in lp.top_logprobs]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def run_all(stack, while_running=None, tool_placed=None) -> list[Stream]:
    """Every case at once; with tool_placed, the tool-call stream first and alone, and
    tool_placed(stream) called while it runs (to learn which decode worker runs it)."""
    streams = [Stream() for _ in cases()]
    client = stack.client(timeout=180)
    threads = [threading.Thread(target=s.run, args=(client, case), daemon=True) for s, case in zip(streams, cases())]
    if tool_placed is not None:
        threads[TOOL_CASE].start()
        tool_placed(streams[TOOL_CASE])
    for t in threads:
        if not t.is_alive() and t.ident is None:
            t.start()
    if while_running is not None:
        while_running(streams)
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a stream hung"
    return streams


@pytest.fixture(scope="module")
def stack(request):
    # two of each role: a request has somewhere to go while any one worker restarts (chaos test).
    # Load alone spreads the streams over both decode workers (with the prefix-affinity weight, the
    # one holding the shared system prompt could take all but the tool-call stream, and its death
    # would then move one stream): this test is about the moves, not about where the router puts work.
    # 192M (~270 pages of 16 tokens) per worker: a decode worker holds all 32 streams after the
    # kill (each ~3 pages of its own past the system prompt's shared ones, the tool call ~15)
    up = DuetUp(new_log_dir("up-failover"), "--prefill", "2", "--decode", "2", "--restart-backoff", "0.5",
                kv_cache_memory="192M", env={"DUET_ROUTER_DECODE_TRANSFER_WEIGHT": "0"})
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


def worker_process(stack, worker_id: str) -> psutil.Process:
    return child_process(stack, f"--worker-id {worker_id} ")


def test_a_decode_worker_killed_mid_stream_is_never_seen_by_the_client(stack):
    # the shared system prompt into the prefill workers' caches first: the streams then compute only
    # their questions (as a busy deployment's would); and each grammar once, so the processes start
    # their grammar helpers now (idle), not under the 32 streams
    warm = [dict(cases()[0], max_tokens=1)] * len(PREFILL) + [
        dict(case, max_tokens=3) for case in cases() if "response_format" in case or "tools" in case][-2:] * 2
    warm_up = [threading.Thread(target=Stream().run, args=(stack.client(), case)) for case in warm]
    for t in warm_up:
        t.start()
    for t in warm_up:
        t.join(120)
    unfaulted = run_all(stack)
    for s in unfaulted:
        assert s.error is None, s.error
    n2 = [s for s, case in zip(unfaulted, cases()) if case.get("n") == 2]
    assert n2 and all(len(s.texts) == 2 for s in n2)
    tool = unfaulted[TOOL_CASE]
    assert tool.reasons == {0: "tool_calls"} and [name for name, _ in tool.tool_calls.values()] == ["write_note"]
    assert set(json.loads(tool.tool_calls[0, 0][1])) == set(NOTE_FIELDS)
    schema_done = [s.texts[0] for s, case in zip(unfaulted, cases()) if "response_format" in case
                   and s.reasons[0] == "stop"]
    assert schema_done and all(set(json.loads(t)) == {"answer", "confidence"} for t in schema_done)
    before = stack.gateway_metrics()
    killed = {}

    def tool_placed(stream):
        # alone on the stack, the tool-call stream is the one request a decode worker runs
        def holder():
            if stream.reasons or stream.error:
                raise AssertionError(f"the tool-call stream ended before it was placed: {stream}")
            running = {w: stack.running(w) for w in DECODE}
            return next((w for w, n in running.items() if n == 1), None) if sum(running.values()) == 1 else None
        killed["worker"] = wait_until(holder, 60, "the tool-call stream on a decode worker", interval=0.02)

    def kill_mid_stream(streams):
        # every stream under way (a few chunks in), then the decode worker running the tool-call stream
        wait_until(lambda: all(s.chunks >= 3 or s.error or s.reasons for s in streams), 120,
                   "every stream to be under way", interval=0.05)
        running = {w: stack.running(w) for w in DECODE}
        victim = killed["worker"]
        killed.update(running=running, at=[s.chunks for s in streams], done=sum(bool(s.reasons) for s in streams))
        assert not streams[TOOL_CASE].reasons, "the tool-call stream ended before the kill"
        worker_process(stack, victim).kill()

    wait_until(lambda: all(stack.running(w) == 0 for w in DECODE), 30, "no request running")
    started = time.monotonic()
    faulted = run_all(stack, kill_mid_stream, tool_placed)
    faulted_s = time.monotonic() - started
    # it ran the tool-call stream and about half of the others (the router spreads them by load)
    assert killed["running"][killed["worker"]] >= MIN_ON_VICTIM, killed
    for i, (want, got) in enumerate(zip(unfaulted, faulted)):
        assert got.error is None, (i, got.error)
        assert got.texts == want.texts and got.reasons == want.reasons, (i, killed)
        assert got.tool_calls == want.tool_calls, (i, killed)
        assert got.usage.completion_tokens == want.usage.completion_tokens, i
        assert got.usage.prompt_tokens == want.usage.prompt_tokens, i
        assert [t for t, _, _ in got.logprobs] == [t for t, _, _ in want.logprobs], i
        assert [top for _, _, top in got.logprobs] == [top for _, _, top in want.logprobs], i
        assert all(abs(a - b) < 0.05 for (_, a, _), (_, b, _) in zip(got.logprobs, want.logprobs)), i

    after = stack.gateway_metrics()
    moves = sum(after.value("duet_migrations_total", cause=c) - before.value("duet_migrations_total", cause=c)
                for c in ("decode_stream", "decode_reserve", "kv_handoff", "prefill"))
    assert moves >= killed["running"][killed["worker"]], killed  # at least one move per stream it served
    rebuilt = {src: after.value("duet_migration_rebuilt_tokens_total", source=src)
               - before.value("duet_migration_rebuilt_tokens_total", source=src)
               for src in ("held", "moved", "recomputed")}
    kept = (rebuilt["held"] + rebuilt["moved"]) / max(1.0, sum(rebuilt.values()))
    print(f"failover: {len(faulted)} streams, killed {killed['worker']} running {killed['running']}, "
          f"{killed['done']} ended before it, the tool call {killed['at'][TOOL_CASE]} chunks in, {moves:.0f} moves, "
          f"KV rebuilt by source {rebuilt} ({kept:.0%} held or moved), "
          f"faulted run {faulted_s:.1f} s")
    assert rebuilt["held"] + rebuilt["moved"] > 2 * rebuilt["recomputed"] > 0, rebuilt
    gateway_log = (stack.log_dir / "gateway.log").read_text()
    assert f"request {faulted[TOOL_CASE].id}: " in gateway_log, "the tool-call stream never moved"
    survivor = next(w for w in DECODE if w != killed["worker"])
    stack.wait_idle([*PREFILL, survivor], timeout=30)
    assert "restarted " + killed["worker"] in stack.proc.log_text() or wait_until(
        lambda: "restarted " + killed["worker"] in stack.proc.log_text(), 30, "duet up to restart the worker")


# --- chaos: a worker killed at a time under steady load ------------------------------------------

CHAOS_KILLS = 3
CHAOS_SEED = 42
CHAOS_CLIENTS = 6
CHAOS_MAX_TOKENS = 8
RSS_GROWTH = 40 << 20  # bytes the gateway may grow by from after the warm-up to the end
RESTART_DEADLINE_S = 120.0  # a busy 2-core machine restarts a worker in well under a minute


def chaos_bodies() -> list[dict]:
    """What the load sends, in turn: greedy and seeded streams of a few questions (each body's
    answer is fixed, whichever workers serve it and however often they die under it)."""
    out = []
    for question in QUESTIONS[:4]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=2024)):
            out.append(dict(messages=messages, max_tokens=CHAOS_MAX_TOKENS, extra_body={"ignore_eos": True}, **kw))
    return out


@dataclass
class SteadyLoad:
    """Client threads, each looping over the bodies (from its own offset) until stopped: what each
    body was answered, and every error."""

    stack: DuetUp
    bodies: list[dict] = field(default_factory=chaos_bodies)
    answers: dict[int, list[tuple]] = field(default_factory=dict)  # body -> [(text, finish, tokens)]
    errors: list[tuple[int, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, clients: int) -> "SteadyLoad":
        self.threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()
        return self

    def _loop(self, offset: int) -> None:
        client = self.stack.client(timeout=120)
        for i in range(offset, 1 << 30):
            if self.stop.is_set():
                return
            body = i % len(self.bodies)
            s = Stream()
            s.run(client, self.bodies[body])
            with self.lock:
                if s.error is not None or s.usage is None:
                    self.errors.append((body, repr(s.error) if s.error else "no usage chunk"))
                else:
                    self.answers.setdefault(body, []).append((s.texts.get(0), s.reasons.get(0),
                                                              s.usage.completion_tokens))

    @property
    def served(self) -> int:
        with self.lock:
            return sum(len(a) for a in self.answers.values())

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
            assert not t.is_alive(), "a load client hung"


def chaos_victims(rng: random.Random, roles: dict[str, str], kills: int) -> list[str]:
    """`kills` workers drawn at random, the last redrawn from a role none of the others has."""
    workers = sorted(roles)
    victims = [rng.choice(workers) for _ in range(kills)]
    for role in sorted(set(roles.values()) - {roles[v] for v in victims}):
        victims[-1] = rng.choice([w for w in workers if roles[w] == role])
    return victims


def listening_ports(proc: psutil.Process) -> set[int]:
    return {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def registry_is_the_live_workers(stack) -> bool:
    """Exactly WORKERS are registered, and each entry's gRPC and metrics ports are served by that
    worker's live process (not a dead instance's leftover)."""
    entries = stack.workers()
    if set(entries) != set(WORKERS):
        return False
    for w, entry in entries.items():
        ports = listening_ports(worker_process(stack, w))
        if {int(entry["address"].rsplit(":", 1)[1]), int(entry["metrics"].rsplit(":", 1)[1])} - ports:
            return False
    return True


def test_workers_killed_in_turn_under_load_lose_no_request_and_leak_nothing(stack):
    wait_until(lambda: registry_is_the_live_workers(stack), RESTART_DEADLINE_S, "every worker registered and live")
    roles = {w: e["role"] for w, e in stack.workers().items()}
    assert sorted(roles.values()) == ["decode", "decode", "prefill", "prefill"], roles
    rng = random.Random(CHAOS_SEED)
    victims = chaos_victims(rng, roles, CHAOS_KILLS)
    gateway = psutil.Process(stack.gateway_pid())
    load = SteadyLoad(stack).start(CHAOS_CLIENTS)
    started = time.monotonic()
    try:
        wait_until(lambda: load.served >= 2 * CHAOS_CLIENTS or load.errors, 120, "the load under way")
        rss_start = gateway.memory_info().rss
        before = stack.gateway_metrics()
        restarts = []
        for victim in victims:
            nonce = stack.workers()[victim]["instance_nonce"]
            worker_process(stack, victim).kill()
            killed_at = time.monotonic()
            wait_until(lambda: stack.workers().get(victim, {}).get("instance_nonce", nonce) != nonce,
                       RESTART_DEADLINE_S, f"{victim} restarted and registered again", interval=0.1)
            restarts.append(time.monotonic() - killed_at)
            time.sleep(rng.uniform(2, 5))
    finally:
        load.finish()
    assert not load.errors, load.errors[:5]
    for body, answers in load.answers.items():
        assert len(set(answers)) == 1, (body, set(answers))  # greedy and seeded: the same every time
        assert answers[0][1:] == ("length", CHAOS_MAX_TOKENS), answers[0]
    wait_until(lambda: registry_is_the_live_workers(stack), 30, "exactly the live workers registered")
    stack.wait_idle(WORKERS, timeout=60)
    for w in WORKERS:
        m = stack.metrics(w)
        assert m.has("duet_kv_unaccounted_pages"), f"{w} never read its accounting while idle"
        for tier in ("device", "host"):
            assert m.value("duet_kv_unaccounted_pages", tier=tier) == 0, (w, tier)
    wait_until(lambda: stack.router_metrics().value("duet_router_inflight_requests") == 0, 30,
               "the router's load account back to zero")
    after = stack.gateway_metrics()
    moves = {c: after.value("duet_migrations_total", cause=c) - before.value("duet_migrations_total", cause=c)
             for c in ("decode_stream", "decode_reserve", "kv_handoff", "prefill")}
    given_up = after.value("duet_migrations_given_up_total") - before.value("duet_migrations_given_up_total")
    rss_end = gateway.memory_info().rss
    kills = {w: victims.count(w) for w in WORKERS}
    print(f"chaos: {len(victims)} kills {kills} over {time.monotonic() - started:.0f} s (restarted in "
          f"{', '.join(f'{s:.1f}' for s in restarts)} s), {load.served} requests served, 0 failed, "
          f"migrations {({c: int(n) for c, n in moves.items() if n})}, gateway RSS "
          f"{rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB")
    assert given_up == 0
    assert sum(moves.values()) > 0, moves  # the kills hit requests in flight
    assert rss_end - rss_start < RSS_GROWTH, (rss_start, rss_end)
