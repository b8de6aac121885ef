"""`duet loadtest multiturn` end to end, against real HTTP servers.

* The Duet gateway (`duet gateway`, the in-process engine on the embedded default model):
  each workload replays a few short conversations; each turn's prompt must carry the
  model's previous answers, the server's prompt counts must equal ours, and from turn 1 on
  the prefix cache must serve part of the prompt (usage cached_tokens).
* The scripted server of test_loadtest_scripted_server: it refuses chosen requests with
  429, so errors land on known turns, and it records the bodies it received."""
from __future__ import annotations

import json

import pytest

from loadtest.__main__ import main as loadtest_main
from tests.helpers.redis_server import free_port
from tests.helpers.stack import Process, duet_argv, http_status, wait_until
from tests.loadtest.test_loadtest_scripted_server import serve, tokenizer  # noqa: F401  (fixtures)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from shared.model_files.default_model import ensure_default_model

    model_dir = ensure_default_model()
    port = free_port()
    proc = Process("gateway", duet_argv("gateway", "--host", "127.0.0.1", "--port", str(port)),
                   tmp_path_factory.mktemp("gw") / "gateway.log").start()
    try:
        wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200 or not proc.alive, 240,
                   "the gateway's engine to load")
        assert proc.alive, proc.tail()
        yield f"http://127.0.0.1:{port}", str(model_dir)
    finally:
        proc.stop()


def _run(url: str, tok: str, out, *args: str) -> dict:
    rc = loadtest_main(["multiturn", "--base-url", url, "--tokenizer", tok, "-o", str(out), "--no-progress",
                        "--save-text", *args])
    assert rc == 0
    for name in ("results.json", "report.txt", "ttft_by_turn.png"):
        assert (out / name).exists(), name
    assert (out / "ttft_by_turn.png").read_bytes()[:8] == PNG_MAGIC
    return json.loads((out / "results.json").read_text())


def _check_history(records: list[dict]) -> None:
    """Turn t+1 of a conversation sends turn t's messages, then turn t's streamed answer."""
    by = {(r["conversation"], r["turn"]): r for r in records}
    for (c, t), r in by.items():
        if t == 0:
            continue
        prev = by[(c, t - 1)]
        n = len(prev["messages"])
        assert r["messages"][:n] == prev["messages"]
        assert r["messages"][n]["role"] == "assistant"
        assert r["messages"][n]["content"] == prev["output_text"] and prev["output_text"]


def test_synthetic_lockstep_against_the_gateway(gateway, tmp_path, capsys):
    url, tok = gateway
    out = tmp_path / "syn"
    doc = _run(url, tok, out, "--workload", "synthetic", "--conversations", "2", "--max-turns", "3",
               "--system-len", "96", "--user-len", "8", "--output-len", "4", "--ignore-eos", "on",
               "--label", "colocated", "--scrape-metrics", url.rstrip("/") + "/metrics")
    table = capsys.readouterr().out
    records = doc["records"]
    assert sorted((r["conversation"], r["turn"]) for r in records) == [(c, t) for c in range(2) for t in range(3)]
    assert all(r["ok"] for r in records), [r["error_detail"] for r in records]
    assert doc["max_context_tokens"] > 0  # from /v1/models
    assert doc["requests_sent"] == 1 + 6 and doc["conversations"] == [
        {"conversation": c, "planned_turns": 3, "turns_sent": 3, "ended": "finished"} for c in range(2)]
    _check_history(records)
    for r in records:
        assert r["usage_prompt_tokens"] == r["prompt_len"]  # the server saw the prompt we counted
        assert r["usage_completion_tokens"] == 4  # ignore_eos honoured
        if r["turn"] > 0:  # the earlier turns' prefix came from the cache
            assert r["usage_cached_tokens"] >= 96
    # Lockstep: no turn t+1 before every turn t had finished.
    for t in (1, 2):
        assert min(r["sent_at"] for r in records if r["turn"] == t) >= max(
            r["done_at"] for r in records if r["turn"] == t - 1)
    by_turn = doc["summary"]["by_turn"]
    assert [(b["turn"], b["requests"], b["completed"]) for b in by_turn] == [(0, 2, 2), (1, 2, 2), (2, 2, 2)]
    assert by_turn[0]["cache"]["share"] < by_turn[1]["cache"]["share"]
    assert all(b["ttft"]["p50"] > 0 for b in by_turn)
    assert "cached %" in table and "Conversations: 2 (finished 2)" in table
    # the server's counters before the first round and after each (--scrape-metrics)
    rounds = doc["round_metrics"]
    assert [r["turn"] for r in rounds] == [-1, 0, 1, 2]
    done = [sum(v for k, v in next(iter(r["series"].values())).items()
                if k.startswith("duet_requests_total") and 'outcome="ok"' in k) for r in rounds]
    assert done[1] < done[2] < done[3], done  # each round's requests counted after it


def test_sharegpt_poisson_and_agentic_then_compare(gateway, tmp_path, capsys):
    url, tok = gateway
    sg = _run(url, tok, tmp_path / "sg", "--workload", "sharegpt", "--conversations", "2", "--max-turns", "2",
              "--output-len", "4", "--max-context-tokens", "1024", "--conversation-rate", "4", "--think-time", "0.2",
              "--ignore-eos", "on", "--label", "sharegpt")
    assert sg["mode"] == "poisson" and len(sg["records"]) == 4 and all(r["ok"] for r in sg["records"])
    _check_history(sg["records"])
    assert all(r["usage_prompt_tokens"] == r["prompt_len"] for r in sg["records"])
    for c in range(2):  # each next turn waited for its answer and then some think time
        t0, t1 = (next(r for r in sg["records"] if (r["conversation"], r["turn"]) == (c, t)) for t in (0, 1))
        assert t1["sent_at"] >= t0["done_at"] and t1["scheduled_at"] >= t0["done_at"]

    ag = _run(url, tok, tmp_path / "ag", "--workload", "agentic", "--conversations", "2", "--max-turns", "2",
              "--system-len", "64", "--num-tools", "3", "--user-len", "8", "--tool-output-len", "24",
              "--output-len", "4", "--conversation-rate", "inf", "--think-time", "0", "--ignore-eos", "on",
              "--label", "agentic")
    records = ag["records"]
    assert len(records) == 4 and all(r["ok"] for r in records), [r["error_detail"] for r in records]
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        assert roles == (["system", "user"] if r["turn"] == 0 else ["system", "user", "assistant", "tool"])
    second = [r for r in records if r["turn"] == 1]
    for r in second:  # the answer went back with a call, and the tool message answers it
        answer, result = r["messages"][2], r["messages"][3]
        assert answer["tool_calls"][0]["id"] == result["tool_call_id"]
        first = next(x for x in records if (x["conversation"], x["turn"]) == (r["conversation"], 0))
        assert answer["content"] == first["output_text"]
        assert r["usage_cached_tokens"] > 0
    capsys.readouterr()

    cmp = tmp_path / "cmp"
    assert loadtest_main(["multiturn", "compare", str(tmp_path / "sg" / "results.json"),
                          str(tmp_path / "ag" / "results.json"), "-o", str(cmp)]) == 0
    text = capsys.readouterr().out
    assert "Runs: sharegpt, agentic" in text and "TTFT p99 (ms)" in text
    assert (cmp / "compare.txt").read_text().strip() == text.strip()
    assert (cmp / "compare_ttft_by_turn.png").read_bytes()[:8] == PNG_MAGIC


def test_errors_by_turn_and_bodies_seen_by_a_scripted_server(serve, tmp_path):  # noqa: F811
    # 3 conversations x 3 turns in lockstep; every 4th request is refused with 429 (no probe:
    # ignore_eos on; no warm-up): requests 1-3 are turn 0, 4-6 turn 1, 7-8 turn 2.
    script, url = serve(ttft_s=0.05, itl_s=0.01, fail_429_every=4)
    out = tmp_path / "s"
    rc = loadtest_main(["multiturn", "--base-url", url, "--tokenizer", _tok_dir(), "--workload", "synthetic",
                        "--conversations", "3", "--max-turns", "3", "--system-len", "40", "--user-len", "6",
                        "--output-len", "3", "--ignore-eos", "on", "--warmup-requests", "0", "-o", str(out),
                        "--no-progress", "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    by_turn = {b["turn"]: b for b in doc["summary"]["by_turn"]}
    assert [(b["requests"], b["completed"], b["http_429"]) for b in by_turn.values()] == [(3, 3, 0), (3, 2, 1),
                                                                                          (2, 1, 1)]
    assert by_turn[1]["errors"] == {"http_429": 1}
    assert script.received == doc["requests_sent"] == 8
    assert sorted(c["ended"] for c in doc["conversations"]) == ["error", "error", "finished"]
    # What the server received: each later body extends an earlier one by the scripted answer.
    answer = " hello" * 3
    bodies = script.bodies
    for b in bodies[3:]:
        msgs = b["messages"]
        assert [m["role"] for m in msgs[:3]] == ["system", "user", "assistant"] and msgs[2]["content"] == answer
        earlier = [e for e in bodies if len(e["messages"]) == len(msgs) - 2 and e["messages"] == msgs[:-2]]
        assert len(earlier) == 1
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] is True and b["stream_options"]["include_usage"]
               for b in bodies)
    turn0 = [r for r in doc["records"] if r["turn"] == 0]
    assert all(50 <= r["ttft"] * 1000 < 400 for r in turn0)


def _tok_dir() -> str:
    from shared.model_files.default_model import ensure_default_model

    return str(ensure_default_model())
