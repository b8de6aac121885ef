"""The load generator against a real HTTP server whose timing and faults we script.

The server streams OpenAI SSE with a known time to first token and a known gap
between tokens, fails chosen requests, and counts what it received; the test checks
the load generator's report against those known numbers and counts."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from loadtest.__main__ import main as loadtest_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Script:
    """How the server behaves, and what it saw."""

    tokenizer: object
    ttft_s: float = 0.25
    itl_s: float = 0.05
    fail_429_every: int | None = None  # the n-th request (1-based) with n % k == 0 gets a 429
    stream_error_every: int | None = None  # ... gets an error event after its first token
    reject_ignore_eos: bool = False
    interrupt_at: int | None = None  # on the n-th request, Ctrl-C the client process
    interrupt_pid: int | None = None  # the client (a child process); set after it starts
    received: int = 0
    statuses: list[int] = field(default_factory=list)
    stream_errors: int = 0
    bodies: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    prompt_tokens_reported: int = 0
    completion_tokens_reported: int = 0

    def prompt_tokens(self, body: dict) -> int:
        if "messages" in body:
            ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return len(self.tokenizer(body["prompt"])["input_ids"])


def _chunk(chat: bool, text: str | None = None, finish: str | None = None, usage: dict | None = None,
           role: bool = False) -> bytes:
    if chat:
        delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    obj = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}
    if usage:
        obj["usage"] = usage
    return f"data: {json.dumps(obj)}\n\n".encode()


def make_app(script: Script) -> Starlette:
    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": "scripted-model", "object": "model"}]})

    async def generate(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        script.received += 1
        n = script.received
        script.bodies.append(body)
        script.arrivals.append(time.perf_counter())
        if script.interrupt_at == n and script.interrupt_pid is not None:
            os.kill(script.interrupt_pid, signal.SIGINT)
        if script.reject_ignore_eos and "ignore_eos" in body:
            script.statuses.append(422)
            return JSONResponse({"detail": "Unexpected fields in the request: {'ignore_eos'}"}, status_code=422)
        if script.fail_429_every and n % script.fail_429_every == 0:
            script.statuses.append(429)
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit"}}, status_code=429)
        script.statuses.append(200)
        max_tokens = int(body["max_tokens"])
        fail_midway = bool(script.stream_error_every and n % script.stream_error_every == 0)

        async def stream():
            script.in_flight += 1
            script.max_in_flight = max(script.max_in_flight, script.in_flight)
            try:
                if chat:
                    yield _chunk(chat, role=True)  # at once, as real servers do: not a token
                await asyncio.sleep(script.ttft_s)
                for i in range(max_tokens):
                    if i:
                        await asyncio.sleep(script.itl_s)
                    yield _chunk(chat, " hello")
                    if fail_midway:
                        script.stream_errors += 1
                        yield b'data: {"error": {"message": "decode worker lost", "code": 500}}\n\n'
                        return
                usage = {"prompt_tokens": script.prompt_tokens(body), "completion_tokens": max_tokens}
                usage["total_tokens"] = usage["prompt_tokens"] + max_tokens
                script.prompt_tokens_reported += usage["prompt_tokens"]
                script.completion_tokens_reported += max_tokens
                yield _chunk(chat, finish="length", usage=usage)
                yield b"data: [DONE]\n\n"
            finally:
                script.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
    ])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.model_files.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.fixture
def serve(tokenizer):
    """Start a scripted server in a thread; yields a function script -> base URL."""
    servers = []

    def start(**kw) -> tuple[Script, str]:
        script = Script(tokenizer=tokenizer, **kw)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(make_app(script), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 20
        while not server.started:
            assert time.time() < deadline, "scripted server did not start"
            time.sleep(0.05)
        servers.append((server, thread))
        return script, f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def _results(out_dir) -> dict:
    return json.loads((out_dir / "results.json").read_text())


def _tok_dir() -> str:
    from shared.model_files.default_model import ensure_default_model

    return str(ensure_default_model())


def test_sweep_reports_scripted_latencies_errors_goodput_and_writes_files(serve, tmp_path, capsys):
    script, url = serve(ttft_s=0.25, itl_s=0.05, fail_429_every=5, stream_error_every=7)
    out = tmp_path / "a"
    rc = loadtest_main([
        "--base-url", url, "--tokenizer", _tok_dir(), "--workload", "random", "--input-len", "20",
        "--output-len", "6", "-n", "10", "-r", "20,40", "--slo-ttft-ms", "1500", "--slo-tpot-ms", "300",
        "-o", str(out), "--no-progress", "--label", "slow"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "TTFT mean / p50 (ms)" in table and "20 req/s" in table and "40 req/s" in table

    doc = _results(out)
    # Everything the server received is accounted for: probe + warm-up + 2 runs of 10.
    assert doc["requests_sent"] == script.received == 1 + 1 + 20
    assert doc["model"] == "scripted-model"  # discovered from /v1/models
    runs = doc["runs"]
    assert [r["label"] for r in runs] == ["20 req/s", "40 req/s"]
    errors: dict[str, int] = {}
    for r in runs:
        for k, v in r["summary"]["errors"].items():
            errors[k] = errors.get(k, 0) + v
    # Requests 5, 10, 15, 20 were refused, 7, 14, 21 broke mid-stream (the probe is 1, warm-up 2).
    assert errors == {"http_429": script.statuses.count(429), "stream_error": script.stream_errors}
    assert errors == {"http_429": 4, "stream_error": 3}

    completed = sum(r["summary"]["completed"] for r in runs)
    assert completed == 20 - 7
    for r in runs:
        s = r["summary"]
        assert s["requests"] == 10
        # Known timing: first text 250 ms after sending (the role chunk before it is not a token),
        # then 5 more tokens 50 ms apart. Upper bounds are loose: two busy cores (472 ms seen once
        # in a whole-suite run beside another test); below 500 it is still not the end of the stream.
        assert 250 <= s["ttft"]["p50"] < 500
        assert 50 <= s["itl"]["p50"] < 110
        assert 50 <= s["tpot"]["mean"] < 110
        assert 500 <= s["e2e"]["p50"] < 800
        assert s["output_tokens"] == 6 * s["completed"]
        # Generous SLOs: every finished request is good, failures are not.
        assert s["goodput"]["good"] == s["completed"]
        assert s["goodput"]["share"] == pytest.approx(s["completed"] / 10)
        tc = s["token_check"]
        assert tc["prompt_mismatches"] == 0 and tc["output_mismatches"] == 0
        assert tc["output_usage_total"] == tc["output_tokenizer_total"] == 6 * s["completed"]
    warm_and_runs = runs[0]["warmup"] + [rec for r in runs for rec in r["records"]]
    # What the server reported, summed, is what we kept, plus the one-token probe (the first prompt).
    first = next(rec for rec in runs[0]["records"] if rec["index"] == 0)
    ok_prompt = sum(rec["usage_prompt_tokens"] for rec in warm_and_runs if rec["ok"])
    ok_output = sum(rec["usage_completion_tokens"] for rec in warm_and_runs if rec["ok"])
    assert ok_prompt + first["prompt_len"] == script.prompt_tokens_reported
    assert ok_output + 1 == script.completion_tokens_reported
    # The rate was honoured: 10 sends at 40 req/s take about a quarter second, at 20 about half.
    span = lambda r: max(x["sent_at"] for x in r["records"]) - min(x["sent_at"] for x in r["records"])  # noqa: E731
    assert span(runs[1]) < span(runs[0]) * 1.5 + 0.1

    for name in ("latency_cdf.png", "sweep.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert "Goodput SLO: TTFT <= 1500 ms, TPOT <= 300 ms" in (out / "report.txt").read_text()

    # Re-judged later under a TTFT target no request met: goodput drops to zero.
    assert loadtest_main(["report", str(out / "results.json"), "--slo-ttft-ms", "100"]) == 0
    text = capsys.readouterr().out
    goodput_row = next(line for line in text.splitlines() if line.startswith("Goodput (share"))
    assert goodput_row.split()[-2:] == ["0.0%", "0.0%"]

    # A faster server, compared with the first: TTFT better, request counts shown side by side.
    script_b, url_b = serve(ttft_s=0.05, itl_s=0.05)
    out_b = tmp_path / "b"
    assert loadtest_main([
        "--base-url", url_b, "--tokenizer", _tok_dir(), "--workload", "random", "--input-len", "20",
        "--output-len", "6", "-n", "10", "-r", "20,40", "-o", str(out_b), "--no-progress", "--label", "fast"]) == 0
    capsys.readouterr()
    assert loadtest_main(["compare", str(out / "results.json"), str(out_b / "results.json"),
                          "-o", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    assert "A = slow" in text and "B = fast" in text
    ttft_rows = [line for line in text.splitlines() if line.startswith("TTFT p50")]
    assert len(ttft_rows) == 2 and all(row.endswith("better") for row in ttft_rows)
    failed_rows = [line for line in text.splitlines() if line.startswith("Requests failed")]
    assert all(row.split()[2:4] in (["4", "0"], ["3", "0"]) for row in failed_rows)
    assert (tmp_path / "cmp" / "compare_latency_cdf.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "cmp" / "compare_sweep.png").read_bytes()[:8] == PNG_MAGIC


def test_fixed_concurrency_with_duration_bound_and_shared_prefix(serve, tmp_path):
    script, url = serve(ttft_s=0.1, itl_s=0.02)
    out = tmp_path / "c"
    started = time.perf_counter()
    rc = loadtest_main([
        "--base-url", url, "--tokenizer", _tok_dir(), "--workload", "shared-prefix", "--sp-groups", "3",
        "--sp-system-len", "200", "--sp-question-len", "10", "--sp-output-len", "5",
        "-c", "3", "--duration", "1.5", "--warmup-requests", "0", "--ignore-eos", "on",
        "-o", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    doc = _results(out)
    (run,) = doc["runs"]
    records = run["records"]
    assert run["label"] == "conc 3"
    assert script.max_in_flight == 3  # the cap held, and the closed loop kept it full
    assert script.received == doc["requests_sent"] == len(records)  # no probe when ignore_eos is on
    # Each request takes about 0.1 + 4 * 0.02 s, three at a time, for 1.5 s: far more than
    # the 12-request pool, which is cycled; nothing is sent after the deadline.
    assert len(records) > 12
    assert max(r["sent_at"] for r in records) < 1.5
    assert all(r["ok"] for r in records)
    assert time.perf_counter() - started < 60
    # Three distinct system prompts of exactly 200 tokens, shared across requests.
    systems = {b["messages"][0]["content"] for b in script.bodies}
    assert len(systems) == 3
    for text in systems:
        assert len(script.tokenizer(text, add_special_tokens=False)["input_ids"]) == 200
    assert all(b["ignore_eos"] is True for b in script.bodies)
    s = run["summary"]
    assert s["token_check"]["prompt_mismatches"] == 0
    assert 2.0 < s["mean_concurrency"] <= 3.05


def test_completions_trace_replay_and_server_that_rejects_ignore_eos(serve, tmp_path):
    script, url = serve(ttft_s=0.05, itl_s=0.01, reject_ignore_eos=True)
    trace = tmp_path / "trace.jsonl"
    lines = [  # milliseconds; lines 1 and 2 share their first 64-token block
        {"timestamp": 1000, "input_length": 80, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1400, "input_length": 70, "output_length": 4, "hash_ids": [7, 9]},
        {"timestamp": 1800, "input_len": 33, "output_len": 2},
        {"timestamp": 3000, "input_length": 5, "output_length": 1},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "t"
    rc = loadtest_main([
        "--base-url", url + "/v1", "--model", "scripted-model", "--tokenizer", _tok_dir(), "--api", "completions",
        "--workload", "trace", "--trace", str(trace), "--trace-time-unit", "ms", "--trace-speedup", "2",
        "--trace-block-size", "64", "--warmup-requests", "0", "-o", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    doc = _results(out)
    assert doc["ignore_eos_sent"] is False
    assert script.statuses[0] == 422  # the probe was refused, so the field was dropped for the run
    assert all("ignore_eos" not in b for b in script.bodies[1:])
    assert all("prompt" in b and "messages" not in b for b in script.bodies)
    (run,) = doc["runs"]
    assert run["label"] == "trace" and run["request_rate"] is None
    records = sorted(run["records"], key=lambda r: r["index"])
    # Prompts cost exactly the trace's input lengths on the server, outputs its output lengths.
    assert [r["usage_prompt_tokens"] for r in records] == [80, 70, 33, 5]
    assert [r["usage_completion_tokens"] for r in records] == [3, 4, 2, 1]
    # Sent at the trace's times, twice as fast: 0, 0.2, 0.4, 1.0 s.
    sent = [r["sent_at"] - records[0]["sent_at"] for r in records]
    for got, want in zip(sent, [0.0, 0.2, 0.4, 1.0]):
        assert want - 0.005 <= got < want + 0.15
    # Shared hash id 7: the first 64 tokens of the first two prompts are the same.
    p0, p1 = (script.tokenizer(b["prompt"], add_special_tokens=False)["input_ids"] for b in script.bodies[1:3])
    assert p0[:64] == p1[:64] and p0[64:] != p1[64:70]
    assert not math.isnan(run["summary"]["ttft"]["p50"])


def test_ctrl_c_stops_sending_and_still_reports_what_finished(serve, tmp_path):
    # The client runs as its own process and gets a real SIGINT, as from a terminal (in the
    # test process, a native library loaded by an earlier test may own SIGINT's disposition).
    script, url = serve(ttft_s=0.1, itl_s=0.05, interrupt_at=8)
    out = tmp_path / "i"
    proc = subprocess.Popen([
        sys.executable, "-m", "loadtest", "--base-url", url, "--tokenizer", _tok_dir(), "--workload", "random",
        "--input-len", "10", "--output-len", "6", "-n", "40", "-r", "5,10", "--ignore-eos", "on", "-o", str(out),
        "--no-progress"], cwd=REPO_ROOT,
        # as from a terminal: a test run started in the background (`cmd &` in a script) hands its
        # children SIGINT ignored, and Python then keeps it ignored instead of raising KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    script.interrupt_pid = proc.pid
    try:
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130
    doc = _results(out)
    assert doc["interrupted"] is True
    (run,) = doc["runs"]  # the second rate never started
    records = run["records"]
    # Ctrl-C came with request 8 (warm-up is 1): sending stopped there, not after 40.
    assert 7 <= len(records) <= 9 and script.received == doc["requests_sent"] == 1 + len(records)
    s = run["summary"]
    assert s["completed"] >= 2 and set(s["errors"]) <= {"interrupted"}
    assert s["completed"] + s["errors"].get("interrupted", 0) == len(records)
    assert (out / "report.txt").exists() and (out / "latency_cdf.png").exists()


def test_lora_mix_sends_each_model_by_weight_and_reports_each(serve, tmp_path, capsys):
    """--lora-mix: every request names one of the models or adapters (by weight, from the seed);
    a second table repeats the rows per model, its request counts what the server saw of each."""
    script, url = serve(ttft_s=0.02, itl_s=0.01)
    out = tmp_path / "mix"
    assert loadtest_main([
        "--base-url", url, "--tokenizer", _tok_dir(), "--workload", "random", "--input-len", "12", "--output-len", "3",
        "-n", "24", "--lora-mix", "scripted-model:1,sql:2", "--warmup-requests", "0", "-o", str(out),
        "--no-progress", "--no-plots"]) == 0
    table = capsys.readouterr().out
    sent = [b["model"] for b in script.bodies[1:]]  # after the ignore_eos probe
    assert len(sent) == 24 and set(sent) == {"scripted-model", "sql"}
    assert sent.count("sql") > sent.count("scripted-model")
    per_model = table[table.index(", per model"):]
    row = next(line for line in per_model.splitlines() if line.startswith("Requests ok / failed"))
    assert row.split()[-6:] == [str(sent.count("scripted-model")), "/", "0", str(sent.count("sql")), "/", "0"]
    assert "unpaced scripted-model" in per_model and "unpaced sql" in per_model
    records = _results(out)["runs"][0]["records"]
    assert {r["model"] for r in records} == {"scripted-model", "sql"}
    with pytest.raises(SystemExit):
        loadtest_main(["--base-url", url, "--lora-mix", "sql:-1"])
