"""The load generator against an independent OpenAI server: `transformers serve` on
Duet's default model (CPU, no continuous batching). Its access log is the ground
truth for request counts; its usage fields, checked against the tokenizer, for tokens.

Needs `accelerate` (transformers serve always loads with a device_map)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from loadtest.__main__ import main as loadtest_main

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    from shared.model_files.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_server(model_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("hf") / "serve.log"
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [cli, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--dtype", "float32", "--no-continuous-batching", "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, "transformers serve exited:\n" + log_path.read_text()[-3000:]
            assert time.time() < deadline, "transformers serve did not come up:\n" + log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server we started, and only it
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _access_log(log_path, endpoint: str) -> list[int]:
    """HTTP statuses the server's access log shows for POSTs to one endpoint."""
    pattern = re.compile(rf'"POST {re.escape(endpoint)} HTTP/1\.1" (\d{{3}})')
    return [int(m.group(1)) for m in pattern.finditer(log_path.read_text(errors="replace"))]


def test_completions_counts_match_server_log_and_tokenizer(hf_server, model_dir, tokenizer, tmp_path):
    url, log_path = hf_server
    out = tmp_path / "completions"
    rc = loadtest_main([
        "--base-url", url, "--model", str(model_dir), "--tokenizer", str(model_dir), "--api", "completions",
        "--workload", "random", "--input-len", "24", "--output-len", "8", "-n", "4", "-c", "2",
        "--warmup-requests", "1", "--save-text", "-o", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    s = run["summary"]
    statuses = _access_log(log_path, "/v1/completions")
    # transformers serve refuses ignore_eos (422): the probe found out, the rest went without it.
    assert doc["ignore_eos_sent"] is False
    assert statuses.count(422) == 1 and statuses.count(200) == 1 + 4
    assert len(statuses) == doc["requests_sent"] == 1 + 1 + 4
    assert s["completed"] == 4 and s["failed"] == 0

    for rec in run["records"] + run["warmup"]:
        # Exact-length synthetic prompts: the server counted exactly what we built.
        assert rec["usage_prompt_tokens"] == rec["prompt_len"] == 24
        # This server streams one token a chunk: the chunks we timed are the tokens it counted
        # (less the EOS it does not stream when it stops early).
        n_usage = rec["usage_completion_tokens"]
        assert 1 <= n_usage <= 8
        assert len(rec["chunk_times"]) == n_usage - (rec["finish_reason"] == "stop"), rec
        # Re-encoding generated text may merge a pair of tokens ("\n" "\n" -> "\n\n"): close, not exact.
        n_text = len(tokenizer(rec["output_text"], add_special_tokens=False)["input_ids"])
        assert rec["output_tokens_tokenizer"] == n_text and abs(n_usage - n_text) <= 1, rec
    assert s["input_tokens"] == 24 * 4
    assert s["output_tokens"] == sum(r["usage_completion_tokens"] for r in run["records"])
    assert s["ttft"]["count"] == 4 and s["ttft"]["p50"] > 0 and s["e2e"]["p50"] >= s["ttft"]["p50"]


def test_chat_sharegpt_prompt_counts_match_server_usage(hf_server, model_dir, tmp_path):
    url, log_path = hf_server
    before = _access_log(log_path, "/v1/chat/completions")
    out = tmp_path / "chat"
    rc = loadtest_main([
        "--base-url", url + "/v1", "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--workload", "sharegpt", "--sharegpt-output-len", "6", "--sharegpt-max-prompt-len", "96",
        "-n", "2", "-r", "4", "--warmup-requests", "0", "--ignore-eos", "off", "-o", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    after = _access_log(log_path, "/v1/chat/completions")
    assert after[len(before):] == [200, 200] and doc["requests_sent"] == 2
    tc = run["summary"]["token_check"]
    # The chat template applied by the server costs what our tokenizer says it costs.
    assert tc["checked"] == 2 and tc["missing_usage"] == 0 and tc["prompt_mismatches"] == 0
    assert tc["prompt_usage_total"] == tc["prompt_tokenizer_total"] > 2 * 4
    assert (out / "latency_cdf.png").exists()
