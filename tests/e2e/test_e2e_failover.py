"""Failover the client never sees, end to end (services/gateway/backends/migration.py):
`duet up` with one prefill and two decode workers (its own redis-server, the router and
workers over gRPC, KV moved by NIXL/UCX, the gateway on uvicorn, the official openai
client).

Thirteen concurrent chat streams of every kind the failover must keep right (greedy,
seeded at temperature 1, JSON-schema constrained, n = 2, logprobs with alternatives, a forced
tool call streamed as tool-call deltas) run
once unfaulted, then again while the decode worker serving most of them is SIGKILLed mid
stream: every stream ends with [DONE] and no error, and each one's choices (text, tool calls,
finish reason, token logprobs) and usage equal the unfaulted run's. The gateway's metrics say the
streams moved, and that the KV rebuilt for them was mostly moved from the prefill worker's
cache or held by the new decode worker, not recomputed. Afterwards no worker holds a page
or a request."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest

from tests.helpers.stack import DuetUp, managed, new_log_dir, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 28
# a long shared system prompt: the prefill worker keeps its pages, so a moved stream's KV is
# mostly moved from there rather than computed again
SYSTEM = ("You are a patient tutor for a class of curious twelve-year-olds. You explain one idea at a time, "
          "in plain words, with one concrete everyday example, and you never use jargon without saying what "
          "it means. When a question has a short factual answer you give it first and then explain why. "
          "You keep every answer under a hundred words, you do not use lists or headings, and you end with "
          "one short question that checks the student understood. You are friendly but never silly, and "
          "you always stay on the topic the student asked about.")
QUESTIONS = ["Why is the sky blue?", "How do bees make honey?", "What makes a rainbow?",
             "Why do we have seasons?", "How does a compass work?", "Why does ice float?",
             "What is a shadow?", "How do plants drink water?", "Why is the sea salty?",
             "How does a bicycle stay up?", "What is an echo?", "Why do cats purr?"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}


# several arguments of fixed phrases (about 140 tokens in all), so the call still streams when the
# others are a few tokens in (it is placed first and alone; at the kill it is ~5 tokens in), and
# always ends within max_tokens (enums compile fast; a length bound would not)
_MOON = ("the moon reflects the light of the sun, so we see more or less of its sunlit half as it goes "
         "around the earth")
_TIDES = "the pull of the moon lifts the oceans a little, so every coast passes two bulges of water each day"
_CHECK = "if the moon were twice as far away, would the tides be bigger or smaller, and why"
NOTE_FIELDS = {
    "explanation": [_MOON, _TIDES],
    "example": [_TIDES, _MOON],
    "summary": [_MOON + ", while " + _TIDES, _TIDES + ", while " + _MOON],
    "question": [_CHECK, _CHECK.replace("twice as far away", "half as far away")],
}
NOTE_TOOL = {"type": "function", "function": {
    "name": "write_note", "description": "Write a short note for the class.",
    "parameters": {"type": "object", "properties": {k: {"enum": v} for k, v in NOTE_FIELDS.items()},
                   "required": list(NOTE_FIELDS), "additionalProperties": False}}}
TOOL_CASE = len(QUESTIONS)  # its index in cases()


def cases() -> list[dict]:
    """Per stream, the request's arguments: three of each kind, two with logprobs."""
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
        out.append(dict(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                        max_tokens=MAX_TOKENS, **kw))
    # a forced tool call (the grammar ends it), its arguments streamed as tool-call deltas
    out.append(dict(messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Write a note for the class about the moon."}],
                    max_tokens=8 * MAX_TOKENS, temperature=0, tools=[NOTE_TOOL],
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
    # load alone spreads the streams over both decode workers (with the prefix-affinity weight, the
    # one holding the shared system prompt could take all but the tool-call stream, and its death
    # would then move one stream): this test is about the moves, not about where the router puts work
    up = DuetUp(new_log_dir("up-failover"), "--decode", "2", "--restart-backoff", "0.5",
                env={"DUET_ROUTER_DECODE_TRANSFER_WEIGHT": "0"})
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


def decode_process(stack, worker_id: str) -> psutil.Process:
    for child in psutil.Process(stack.proc.pid).children(recursive=True):
        if f"--worker-id {worker_id}" in " ".join(child.cmdline()):
            return child
    raise LookupError(worker_id)


def test_a_decode_worker_killed_mid_stream_is_never_seen_by_the_client(stack):
    # the shared system prompt into the prefill worker's cache first: the streams then compute only their
    # questions (as a busy deployment's would)
    stack.client().chat.completions.create(model=MODEL, max_tokens=1, messages=cases()[0]["messages"])
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
            running = {w: stack.running(w) for w in ("decode-0", "decode-1")}
            return next((w for w, n in running.items() if n == 1), None) if sum(running.values()) == 1 else None
        killed["worker"] = wait_until(holder, 60, "the tool-call stream on a decode worker", interval=0.02)

    def kill_mid_stream(streams):
        # every stream under way (a few chunks in), then the decode worker running the tool-call stream
        wait_until(lambda: all(s.chunks >= 3 or s.error or s.reasons for s in streams), 120,
                   "every stream to be under way", interval=0.05)
        running = {w: stack.running(w) for w in ("decode-0", "decode-1")}
        victim = killed["worker"]
        killed.update(running=running, at=[s.chunks for s in streams])
        assert not streams[TOOL_CASE].reasons, "the tool-call stream ended before the kill"
        decode_process(stack, victim).kill()

    wait_until(lambda: all(stack.running(w) == 0 for w in ("decode-0", "decode-1")), 30, "no request running")
    faulted = run_all(stack, kill_mid_stream, tool_placed)
    # it ran the tool-call stream and more (the router spreads the others by load: not always half)
    assert killed["running"][killed["worker"]] >= 2, killed
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
    print(f"failover: killed {killed['worker']} running {killed['running']}, {moves:.0f} moves, "
          f"KV rebuilt by source {rebuilt}")
    assert rebuilt["held"] + rebuilt["moved"] > 2 * rebuilt["recomputed"] > 0, rebuilt
    gateway_log = (stack.log_dir / "gateway.log").read_text()
    assert f"request {faulted[TOOL_CASE].id}: " in gateway_log, "the tool-call stream never moved"
    survivor = "decode-1" if killed["worker"] == "decode-0" else "decode-0"
    stack.wait_idle(["prefill-0", survivor], timeout=30)
    assert "restarted " + killed["worker"] in stack.proc.log_text() or wait_until(
        lambda: "restarted " + killed["worker"] in stack.proc.log_text(), 30, "duet up to restart the worker")
