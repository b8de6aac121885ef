"""Switchable workers change role under load, through real processes: redis, the router, two
`duet worker --switchable` processes (gRPC, KV over NIXL), the gateway and the official openai
client.

The workers start as a prefill and a decode worker (split). While clients keep sending requests,
and while a long answer streams from the decode worker, both switch to `both` (SetRole, as the
planner calls it), then back. The registry shows each new role at once, the router places on it
(colocated answers after the first switch, split ones after the second), the switch's log line
and metric are there, the worker keeps its KV cache (a conversation's next turn after the switch
still reuses the pages the worker held before), no request fails and every greedy answer equals
the one the split stack gave before any switch. Nothing is left on either worker afterwards.

A switch can also spread the running batch: the decode worker turned `both` hands half of its
decoding streams over (SetRole `hand_over`, as the planner asks after a switch), their gateway
continues them on the other worker from the tokens sent, and every streamed answer is the
split stack's, token for token, with no error."""
from __future__ import annotations

import threading

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.client_loops import ClientLoops
from tests.helpers.stack import ProcessStack, managed, new_log_dir, scrape, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
           "A haiku about the sea:", "To bake bread you need", "The largest planet in the solar system is"]
LONG = "Write a long story about a lighthouse keeper and his cat."


@pytest.fixture(scope="module")
def stack(request):
    s = ProcessStack(new_log_dir("role-switch"), registry_ttl_s=3.0, kv_cache_memory="96M")
    with managed(request, s):
        s.start_redis()
        s.start_router()
        s.add_worker("prefill", "worker-0", ["--switchable"])
        s.add_worker("decode", "worker-1", ["--switchable"])
        s.start_gateway()
        s.wait_ready()
        yield s


def set_role(s, worker_id: str, role: str, hand_over: int = 0) -> duet_pb2.SetRoleReply:
    address = s.workers()[worker_id]["address"]
    with grpc.insecure_channel(address) as channel:
        return duet_pb2_grpc.WorkerAdminStub(channel).SetRole(
            duet_pb2.SetRoleRequest(role=role, reason="test", hand_over=hand_over), timeout=10)


class StreamsRead:
    """Streamed completions of `prompts`, each past its first token on entry, read to their end
    by a thread each; on exit every reader has finished (errors kept in `errors`)."""

    def __init__(self, client, prompts: list[str], ask: dict):
        self.streams = [client.completions.create(prompt=p, stream=True, **ask) for p in prompts]
        self.texts = [[next(iter(st)).choices[0].text] for st in self.streams]
        self.errors: list[BaseException] = []
        self.readers = [threading.Thread(target=self._drain, args=(i,)) for i in range(len(self.streams))]

    def _drain(self, i: int) -> None:
        try:
            self.texts[i] += [chunk.choices[0].text for chunk in self.streams[i]]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def __enter__(self) -> "StreamsRead":
        for t in self.readers:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.readers:
            t.join(120)

    def answers(self) -> list[str]:
        return ["".join(t) for t in self.texts]


def roles(s) -> dict[str, str]:
    return {w: f["role"] for w, f in s.workers().items()}


def decisions(s, kind: str) -> float:
    return scrape(f"127.0.0.1:{s.router_metrics_port}").value("duet_router_decisions_total", kind=kind)


def test_roles_switch_under_load_with_no_failed_request_and_the_same_answers(stack):
    s = stack
    client = s.client()
    assert roles(s) == {"worker-0": "prefill", "worker-1": "decode"}
    assert s.workers()["worker-0"]["switchable"] == "1"
    reference = {i: client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
                 for i, p in enumerate(PROMPTS)}
    long_reference = client.completions.create(model=MODEL, prompt=LONG, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
    # a conversation whose pages the decode worker holds before the switch
    chat = [{"role": "user", "content": "Name a bird that cannot fly."}]
    first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0)
    chat += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Where does it live?"}]

    def ask(k: int, i: int) -> tuple[int, str]:
        n = (k + i) % len(PROMPTS)
        out = client.completions.create(model=MODEL, prompt=PROMPTS[n], max_tokens=10, temperature=0)
        return n, out.choices[0].text

    with ClientLoops(ask, 2) as load:
        wait_until(lambda: len(load.done) >= 2, 120, "the clients' first answers")
        long_stream = client.completions.create(model=MODEL, prompt=LONG, max_tokens=40, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        long_text = [next(iter(long_stream)).choices[0].text]  # decoding on worker-1 now
        colocated = decisions(s, "colocated")
        to_both = [set_role(s, "worker-0", "both"), set_role(s, "worker-1", "both")]
        assert [(r.previous_role, r.role, r.changed) for r in to_both] == [("prefill", "both", True),
                                                                            ("decode", "both", True)]
        assert to_both[1].inflight_requests >= 1  # the long answer still streams from worker-1
        assert roles(s) == {"worker-0": "both", "worker-1": "both"}  # in the registry at once
        wait_until(lambda: decisions(s, "colocated") >= colocated + 3, 120, "colocated answers after the switch")
        long_text += [chunk.choices[0].text for chunk in long_stream]
        # the conversation's next turn on a `both` worker reuses what its worker held before the switch
        second = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= 16

        split = decisions(s, "split")
        back = [set_role(s, "worker-0", "prefill"), set_role(s, "worker-1", "decode")]
        assert [(r.previous_role, r.role) for r in back] == [("both", "prefill"), ("both", "decode")]
        wait_until(lambda: decisions(s, "split") >= split + 3, 120, "split answers after switching back")
        answered = len(load.done)
        wait_until(lambda: len(load.done) >= answered + 2, 120, "more answers")

    assert not load.errors, load.errors
    assert len(load.done) >= 8
    wrong = [(i, text) for i, text in load.done if text != reference[i]]
    assert not wrong, (wrong, reference)
    assert "".join(long_text) == long_reference

    for worker_id, role in (("worker-0", "prefill"), ("worker-1", "decode")):
        m = s.metrics(worker_id)
        assert m.value("duet_worker_role_switches_total", from_role=role, to_role="both") == 1
        assert m.value("duet_worker_role_switches_total", from_role="both", to_role=role) == 1
        assert m.value("duet_worker_role", role=role) == 1 and m.value("duet_worker_role", role="both") == 0
        assert f"role switch: {role} -> both (test)" in s.procs[worker_id].log_text()
    s.wait_idle(["worker-0", "worker-1"], timeout=60)


def test_set_role_refuses_an_unknown_role_and_keeps_the_same_one(stack):
    s = stack
    with pytest.raises(grpc.RpcError) as refused:
        set_role(s, "worker-0", "router")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    same = set_role(s, "worker-0", s.workers()["worker-0"]["role"])
    assert not same.changed and same.role == same.previous_role
    with pytest.raises(grpc.RpcError) as refused:
        set_role(s, "worker-1", "both", hand_over=-1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hand_over" in refused.value.details()
    assert roles(s)["worker-1"] == "decode"  # refused before anything changed


def test_a_decode_worker_turned_both_hands_half_its_streams_over_and_every_answer_stays_the_same(stack):
    s = stack
    client = s.client()
    assert roles(s) == {"worker-0": "prefill", "worker-1": "decode"}
    ask = dict(model=MODEL, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    reference = [client.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    gateway = s.gateway_metrics()
    moved_before = gateway.value("duet_migrations_total", cause="handed_over")
    decoded_before = s.metrics("worker-0").value("duet_engine_tokens_computed_total", phase="decode")
    with StreamsRead(client, PROMPTS, ask) as read:  # all six decoding on worker-1 now
        assert set_role(s, "worker-0", "both").changed  # first: the continuations need a place to land
        reply = set_role(s, "worker-1", "both", hand_over=3)
        assert (reply.changed, reply.handed_over) == (True, 3)
    assert not read.errors, read.errors
    assert read.answers() == reference
    assert s.gateway_metrics().value("duet_migrations_total", cause="handed_over") == moved_before + 3
    assert s.metrics("worker-1").value("duet_worker_streams_handed_over_total") == 3
    # the other worker decoded the three it took over
    assert s.metrics("worker-0").value("duet_engine_tokens_computed_total", phase="decode") > decoded_before
    assert "handed over 3 of the 3 decoding stream(s)" in s.procs["worker-1"].log_text()
    s.wait_idle(["worker-0", "worker-1"], timeout=60)
    back = [set_role(s, "worker-0", "prefill"), set_role(s, "worker-1", "decode")]
    assert [r.role for r in back] == ["prefill", "decode"]


def test_a_worker_turning_prefill_hands_its_streams_over_and_their_pages_move(stack):
    """Both streams' worker turns prefill and hands them all over: their continuations are
    prefilled by it (excluded as a decode worker only: it holds their pages), so their KV moves
    to the new decode worker rather than being recomputed, and every answer is unchanged."""
    s = stack
    client = s.client()
    assert roles(s) == {"worker-0": "prefill", "worker-1": "decode"}
    prompts = [f"{p} Tell it as a long story with many details about the weather, the people and the "
               f"places they visit on the way." for p in PROMPTS[:4]]
    ask = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    # worker-0 serves whole requests alone (so only it holds these prompts' pages), worker-1
    # stands by as a prefill worker
    assert set_role(s, "worker-0", "both").changed and set_role(s, "worker-1", "prefill").changed
    reference = [client.completions.create(prompt=p, **ask).choices[0].text for p in prompts]
    gateway = s.gateway_metrics()
    moved_tokens = gateway.value("duet_migration_rebuilt_tokens_total", source="moved")
    with StreamsRead(client, prompts, ask) as read:  # all four decoding on worker-0 now
        assert set_role(s, "worker-1", "decode").changed  # the new split first, as the planner does
        assert set_role(s, "worker-0", "prefill").changed
        reply = set_role(s, "worker-0", "prefill", hand_over=4)  # then the hand-over, the role unchanged
        assert (reply.changed, reply.handed_over) == (False, 4)
    assert not read.errors, read.errors
    assert read.answers() == reference
    after = s.gateway_metrics()
    assert after.value("duet_migrations_total", cause="handed_over") >= 4
    # their pages went from worker-0's cache to worker-1 over the handoff: moved, not recomputed
    assert after.value("duet_migration_rebuilt_tokens_total", source="moved") - moved_tokens >= 4 * 32
    s.wait_idle(["worker-0", "worker-1"], timeout=60)
