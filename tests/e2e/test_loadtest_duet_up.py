"""The load generator against Duet itself: `duet up` (default model, 1 prefill + 1
decode), checked against what the gateway counted in /metrics: requests by status,
prompt tokens and generated tokens; and `duet bench`'s stack, multiturn and saturation sections on it.

This starts the whole stack (redis, router, two workers, gateway) on CPU."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.__main__ import main as loadtest_main
from loadtest.duet_stack import DuetStack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def duet_stack(tmp_path_factory):
    """`duet up` with its defaults (1 prefill + 1 decode), through the helper the bench's
    stack sections start their stacks with (loadtest/duet_stack.py), so it is exercised here too."""
    from shared.model_files.default_model import ensure_default_model

    model_dir = ensure_default_model()
    stack = DuetStack([], tmp_path_factory.mktemp("duet-up"))
    try:
        stack.start(health_timeout_s=420)
    except RuntimeError as e:
        pytest.fail(f"{e}:\n{(stack.log_dir / 'up.log').read_text()[-4000:]}")
    try:
        yield stack.url, model_dir, stack.log_dir
    finally:
        stack.stop()
        assert stack.proc.poll() is not None


def _counters(url: str) -> dict[str, dict[tuple, float]]:
    """duet_* counter samples by name, keyed by their sorted labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("duet_") and sample.name.endswith("_total"):
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _delta(before, after, name: str, **labels) -> float:
    def total(snapshot):
        return sum(v for k, v in snapshot.get(name, {}).items() if all((lk, lv) in k for lk, lv in labels.items()))

    return total(after) - total(before)


@pytest.mark.parametrize("api,workload", [
    ("completions", ["--workload", "random", "--input-len", "32", "--output-len", "8", "-n", "6", "-r", "4"]),
    ("chat", ["--workload", "sharegpt", "--sharegpt-output-len", "8", "--sharegpt-max-prompt-len", "128",
              "-n", "4", "-c", "2"]),
])
def test_report_matches_gateway_metrics(duet_stack, tmp_path, api, workload):
    url, model_dir, log_dir = duet_stack
    before = _counters(url)
    out = tmp_path / api
    rc = loadtest_main(["--base-url", url, "--api", api, "--tokenizer", str(model_dir), "--ignore-eos", "on",
                        "--warmup-requests", "1", "-o", str(out), "--no-progress", *workload])
    assert rc == 0
    after = _counters(url)
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    s = run["summary"]
    sent = run["warmup"] + run["records"]
    assert s["failed"] == 0, s["errors"]
    # Requests: every one we sent, and nothing else, finished at the gateway with 200.
    assert _delta(before, after, "duet_requests_total") == doc["requests_sent"] == len(sent)
    assert _delta(before, after, "duet_requests_total", status="200") == len(sent)
    # Tokens: the gateway's counters equal the usage it returned, which equals our tokenizer.
    assert _delta(before, after, "duet_prompt_tokens_total") == sum(r["usage_prompt_tokens"] for r in sent)
    assert _delta(before, after, "duet_generation_tokens_total") == sum(r["usage_completion_tokens"] for r in sent)
    assert all(r["usage_prompt_tokens"] == r["prompt_len"] for r in sent)
    assert all(r["usage_completion_tokens"] == 8 for r in sent)  # ignore_eos honoured
    assert s["output_tokens"] == 8 * len(run["records"])
    assert s["token_check"]["prompt_mismatches"] == 0
    assert s["ttft"]["count"] == len(run["records"]) and s["tpot"]["p50"] > 0


def test_bench_stack_sections_measure_this_stack(duet_stack, tmp_path, torch_one_thread, capsys):
    """`duet bench --sections stack,multiturn --base-url`: TTFT by point and by turn, the second
    turn served from the cache, nothing failed (the sections start each --stacks layout through
    the fixture's helper otherwise)."""
    from loadtest.bench.suite import main as bench_main

    url, model_dir, log_dir = duet_stack
    out = tmp_path / "bench.json"
    assert bench_main(["--device", "cpu", "--sections", "stack,multiturn", "--base-url", url, "--model-dir",
                       str(model_dir), "--concurrency", "1", "--stack-lens", "32,8", "--conversations", "2",
                       "--chat", "48,8,4,2", "--steps", "2", "--workdir", str(tmp_path / "work"),
                       "--rates", "2", "--filled-rates", "2", "--seconds-per-rate", "2", "--slo", "60000,5000", "--agentic-rates", "1",
                       "--chat-rates", "1", "--think-seconds", "0.2",
                       "--settle-seconds", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["stack"]["server first run TTFT p50 ms"] > 0 and d["stack"]["server c=1 TTFT p50 ms"] > 0
    assert d["multiturn"]["server C=2 turn 1 TTFT p50 ms"] > 0 and d["multiturn"]["server C=2 turn 2 TTFT p50 ms"] > 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("[stack]", "[multiturn]"))]
    # the first run and c=1, 4 requests each (an agentic line may also read "0 of 4 failed")
    assert sum(line.startswith("[stack]") and "TTFT p50 ms" in line and "0 of 4 failed" in line
               for line in printed) == 2
    # the workers' own decode steps, scraped from the /metrics their ready lines name
    from loadtest.bench.stacks import KV_READING, kv_tiers_text, step_totals, workers_sum
    seconds, steps = step_totals(log_dir)
    assert steps > 0 and seconds > 0
    # and the steps that carried a prompt beside decode rows (a rate point's row beside its decode step)
    mixed_s, mixed = step_totals(log_dir, "mixed")
    assert mixed >= 0 and (mixed_s > 0) == (mixed > 0)
    # and their prefix hits by tier (a stack the section starts gets a row per conversation count)
    kv = workers_sum(log_dir, KV_READING)
    assert kv[0] > 0 and kv[2] == kv[3] == 0, kv  # the second turns hit the device; no host tier on CPU
    assert kv_tiers_text([0.0] * 4, kv) == f"prefix hits {kv[0]:.0f} tokens from device, 0 from host; no host tier"
    # the router's placements by kind, read off its /metrics (its listening line names the port):
    # every request the fixture's stack served was routed; overflow (on with the planner) is a
    # kind of local prefill (on a loaded CPU the prefill worker's queue may pass the target)
    from loadtest.bench.stacks import routes, routes_text
    placed = routes(log_dir)
    assert placed is not None and placed["split"] + placed["local_prefill"] + placed["colocated"] >= 10, placed
    assert placed["split"] > 0 and 0 <= placed["overflow"] <= placed["local_prefill"], placed
    assert routes_text(placed, {**placed, "split": placed["split"] + 3}) == \
        ", routes split 3, local_prefill 0 (overflow 0), colocated 0"
    # open loop: every request of the rate point met the loose SLO; the agentic sessions all finished
    assert d["stack"]["server random 2/s goodput %"] == d["stack"]["server random 2/s filled goodput %"] == 100.0
    # each rate point ran its load unmeasured first (--settle-seconds), into a folder of its own
    from loadtest.results_io import read_results
    settled = read_results(tmp_path / "work" / "server" / "random2-settle" / "results.json").summaries()[0]
    assert settled.requests >= 1 and settled.failed == 0
    agentic = [line for line in printed if line.startswith("[multiturn] server agentic 1/s")]
    assert len(agentic) == 1 and " 0 of " in agentic[0], agentic
    turns = [line for line in printed if line.startswith("[multiturn] server C=2 turn")]
    assert len(turns) == 2 and all("0 of 2 failed" in line for line in turns), turns
    later = float(turns[1].split("cached ")[1].split(",")[0])
    assert 0 < later <= 1  # the second turn found its history in the server's cache
    # chats started at a rate (two in 2 s), each to its last turn after a think time
    staggered = [line for line in printed if line.startswith("[multiturn] server chats 1/s turn")]
    assert len(staggered) == 2 and all("0 of 2 failed" in line for line in staggered), staggered
    assert float(staggered[1].split("cached ")[1].split(",")[0]) > 0


def test_bench_saturation_section_measures_this_stack_beside_the_offline_engine(duet_stack, tmp_path,
                                                                               torch_one_thread):
    """`duet bench --sections saturation --base-url`: the same ShareGPT requests through the engine
    alone and through the stack, all at once; both rates, their ratio and the workers' engine steps
    over the run (the stacks of --stacks, with their processes' CPU, on a GPU host)."""
    from loadtest.bench.suite import main as bench_main

    url, model_dir, _ = duet_stack
    out = tmp_path / "bench.json"
    assert bench_main(["--device", "cpu", "--sections", "saturation", "--base-url", url, "--model-dir",
                       str(model_dir), "--saturation", "6,12", "--workdir", str(tmp_path / "work"),
                       "--json", str(out)]) == 0
    d = json.loads(out.read_text())["saturation"]
    assert "FAILED" not in d, d
    assert d["offline out tok/s"] > 0 and d["server out tok/s"] > 0
    assert d["server / offline per GPU"] == pytest.approx(d["server out tok/s"] / d["offline out tok/s"], rel=0.01)
    from loadtest.results_io import read_results
    s = read_results(tmp_path / "work" / "server" / "saturation" / "results.json").summaries()[0]
    assert (s.requests, s.failed, s.output_tokens) == (6, 0, 6 * 12)  # every request at once, each 12 tokens
