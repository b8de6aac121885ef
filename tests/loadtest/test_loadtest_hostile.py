"""`duet loadtest hostile` against a real small gateway (tests/helpers/hostile_probe_server.py: the
gateway app, its limits and API-key check, a scripted backend, a tiny ChatML tokenizer, and
a fake decode /metrics) in its own process. These tests check the harness: that each probe
records status, the error-JSON check, latency, the gateway's RSS, /health samples, the
victim's latency and the KV trace, and gives a verdict. Whether a probe PASSes or FAILs is a
finding about the server and does not fail a test."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.__main__ import main as loadtest_main
from loadtest.hostile.client import Reply, Server
from loadtest.hostile.config import ProbeSizes
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.kv_metrics import KvWatch, parse_kv_usage
from loadtest.hostile.monitors import GatewayProcess
from loadtest.hostile.probes import all_probes
from loadtest.hostile.result import ProbeResult, is_openai_error
from loadtest.hostile.runner import run_probe, select
from tests.helpers.gateway_support import byte_level_tokenizer_dir, free_port

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-hostile-test"
VERDICTS = {"PASS", "FAIL", "UNCLEAR"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), 256)
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.hostile_probe_server", str(port), str(metrics_port),
                             str(tok), KEY], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the probe server did not start: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.1)
    yield {"base_url": base, "pid": proc.pid, "metrics": f"127.0.0.1:{metrics_port}"}
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


SMALL = ["--probe-timeout-s", "15", "--settle-timeout-s", "5", "--jinja-loop", "1500", "--jinja-concurrency", "2",
         "--bomb-steps-mb", "2,5", "--grammar-repeat", "300", "--admission-prompts", "8", "--admission-tokens", "8",
         "--disconnect-requests", "3", "--disconnect-prompt-words", "50", "--kv-watch-s", "5",
         "--never-fit-n", "4", "--never-fit-max-tokens", "64", "--big-list-prompts", "8", "--stop-strings", "200",
         "--nesting-depth", "300"]


def test_suite_records_every_reading(server, tmp_path, capsys):
    out, md = tmp_path / "hostile.json", tmp_path / "hostile.md"
    only = ("field_top_k_2^40,field_logit_bias_superscript_key,field_responses_content_list_of_ints,"
            "http_bad_chunk_size,http_invalid_json_body,special_tokens_in_content,jinja_template_override,"
            "jinja_memory_bomb,jinja_cpu_burn,schema_response_format,huge_stop_list,"
            "admission_prompt_list_vs_victim,disconnect_x10_staggered")
    code = loadtest_main(["hostile", "--base-url", server["base_url"] + "/v1", "--api-key", KEY,
                          "--gateway-pid", str(server["pid"]), "--worker-metrics", server["metrics"],
                          "--only", only, "--json", str(out), "--markdown", str(md), *SMALL])
    printed = capsys.readouterr().out
    assert code in (0, 1), printed  # 1: some probe FAILs, a finding about the server
    doc = json.loads(out.read_text())
    probes = {p["name"]: p for p in doc["probes"]}
    assert set(probes) == set(only.split(",")), printed
    for p in probes.values():
        assert p["verdict"] in VERDICTS and p["reason"], p
        assert p["health_samples"] > 0 and p["health_p50_ms"] is not None, p
        assert p["rss_before_mb"] > 10 and p["rss_peak_mb"] >= p["rss_before_mb"] and p["rss_after_mb"] > 0, p
        assert p["gateway_cpu_s"] is not None and p["duration_s"] > 0, p
    # a client error that the gateway checks today: recorded as 400 with OpenAI error JSON
    invalid = probes["http_invalid_json_body"]
    assert invalid["status"] == 400 and invalid["error_json"] is True and invalid["verdict"] == "PASS", invalid
    # the superscript key: whatever the gateway answers, the check of the body's shape is recorded
    assert isinstance(probes["field_logit_bias_superscript_key"]["status"], int)
    assert probes["field_logit_bias_superscript_key"]["error_json"] is not None
    # a raw-socket refusal: a status parsed from the wire
    assert isinstance(probes["http_bad_chunk_size"]["status"], int)
    assert probes["special_tokens_in_content"]["details"]["prompt_tokens"]["<|im_end|>"]["whole"] > 0
    assert probes["jinja_template_override"]["details"]["baseline_prompt_tokens"] > 0
    assert [s["mb"] for s in probes["jinja_memory_bomb"]["details"]["steps"]][0] == 2
    victim = probes["admission_prompt_list_vs_victim"]
    assert victim["victim_status"] == 200 and victim["victim_ms"] > 0, victim
    assert victim["details"]["victim_idle_status"] == 200
    disconnect = probes["disconnect_x10_staggered"]
    assert disconnect["kv_trace"], disconnect
    assert "verdict" in printed and "health p50/max ms" in printed
    assert md.read_text().startswith("| probe |")


def test_rss_cap_cuts_a_probe_short(server):
    """A probe past the RSS cap is cancelled and reported, not left to run."""
    async def grow(ctx, r):
        await asyncio.sleep(30)

    async def main():
        from loadtest.hostile.probe import Probe
        probe = Probe("cap", "test", "cut short", grow, lambda r: (not r.aborted, r.aborted or ""), timeout_s=20)
        ctx = ProbeContext(Server(server["base_url"], KEY, "tiny"), ProbeSizes(rss_cap_mb=-1e6, settle_timeout_s=2),
                           GatewayProcess(server["pid"]))
        return await run_probe(probe, ctx)

    started = time.monotonic()
    r = asyncio.run(main())
    assert time.monotonic() - started < 10
    assert r.verdict == "FAIL" and "cap" in r.aborted and r.status == "aborted", r


def test_probe_timeout_is_recorded(server):
    async def slow(ctx, r):
        await asyncio.sleep(30)

    async def main():
        from loadtest.hostile.probe import Probe
        probe = Probe("slow", "test", "", slow, lambda r: (None, "no reading"), timeout_s=1)
        return await run_probe(probe, ProbeContext(Server(server["base_url"], KEY, "tiny"),
                                                   ProbeSizes(settle_timeout_s=2)))

    r = asyncio.run(main())
    assert r.status == "timeout" and r.aborted.startswith("timeout") and r.verdict == "UNCLEAR"
    assert r.rss_before_mb is None and r.health_samples > 0


def test_kv_watch_traces_usage_back_to_zero(server):
    async def main():
        async with httpx.AsyncClient() as http:  # a completion marks the fake KV busy for 0.6 s
            await http.post(server["base_url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {KEY}"})
        return await KvWatch([server["metrics"]]).trace(watch_s=5, interval_s=0.1, idle_for_s=0.3)

    samples, zero_after = asyncio.run(main())
    assert samples[0][1] == 0.25 and samples[-1][1] == 0.0, samples
    assert zero_after is not None and 0.2 < zero_after < 2.0, samples


def test_checks_and_selection():
    assert is_openai_error(b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}')
    assert not is_openai_error(b'{"error": "m"}') and not is_openai_error(b"Invalid HTTP request received.")
    assert not is_openai_error(b'{"error": {"message": "m", "type": "t"}}')
    assert parse_kv_usage('duet_kv_cache_usage_ratio{a="b"} 0.5\nduet_kv_cache_usage_ratio 0.25\n') == 0.5
    assert parse_kv_usage("other 1\n") is None
    r = ProbeResult("x", "3", "400 JSON")
    r.record_reply(Reply(500, b"Internal Server Error", 0.1))
    assert r.status == 500 and r.error_json is False
    names = [p.name for p in all_probes()]
    assert len(names) == len(set(names))
    assert {p.item for p in select(all_probes(), ["5", "6"], [])} == {"5", "6"}
    assert all(p.name.startswith("field_") for p in select(all_probes(), ["field_*"], ["field_n_2^40"]))
