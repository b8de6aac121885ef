"""Fuzzing the gateway from its own OpenAPI document (/openapi.json,
services/gateway/http_edge/openapi.py) with schemathesis: bodies that fit the request
schemas of /v1/chat/completions and /v1/completions (positive) and bodies that break them
(negative: wrong types, missing fields, not JSON), sent to a real gateway process serving
the small default model on an in-process engine. No answer may be a 5xx (bad input is a
4xx with OpenAI's error JSON), and the gateway still serves afterwards. Bounded in time:
max_tokens and n are capped so each case is one short generation, and a budget stops
sending after ~90 s.

Prints the counts (cases, 2xx, 4xx, 5xx). Rerun alone:
    PYTHONPATH=$PWD python -m pytest -q -s tests/gateway/test_gateway_fuzz.py
DUET_FUZZ_EXAMPLES sets the examples per endpoint and mode (default 60); DUET_FUZZ_STACK=split
fuzzes `duet up` (1 prefill + 1 decode over gRPC) instead of the in-process engine."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import requests

from tests.helpers.openai_schema import validate
from tests.helpers.stack import DuetUp, Process, duet_argv, http_status, new_log_dir, wait_until
from tests.helpers.gateway_support import free_port

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("DUET_FUZZ_EXAMPLES", "60"))
BUDGET_S = float(os.environ.get("DUET_FUZZ_BUDGET_S", "90"))
OPERATIONS = ["/v1/chat/completions", "/v1/completions"]
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def gateway():
    if os.environ.get("DUET_FUZZ_STACK") == "split":
        stack = DuetUp(new_log_dir("fuzz-split"), "--prefill", "1", "--decode", "1", env={"DUET_MAX_MODEL_LEN": "512"})
        try:
            stack.start().wait_ready()
            yield stack.base_url.removesuffix("/v1"), stack.proc
        finally:
            stack.close()
            print(f"\nlogs: {stack.log_dir}")
        return
    log_dir = new_log_dir("fuzz")
    port = free_port()
    proc = Process("gateway", duet_argv("gateway", "--backend", "local", "--host", "127.0.0.1", "--port", str(port),
                                        "--max-model-len", "512", "--body-timeout", "10"),
                   log_dir / "gateway.log").start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_status(base + "/health") == 200 or not proc.alive, 240, "the gateway")
        assert proc.alive, proc.tail()
        yield base, proc
    finally:
        proc.stop(grace_s=10)
        print(f"\ngateway log: {log_dir / 'gateway.log'}")


def bounded(case):
    """Keep each case one short generation: cap max_tokens, n and the number of prompts
    (values already out of range stay, so the checks for them are still fuzzed)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[key] = 2
    if isinstance(body.get("messages"), list):  # a short conversation of short messages
        body["messages"] = body["messages"][:4]
        for message in body["messages"]:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = message["content"][:100]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 3 and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:3]
    return case


def test_fuzzed_requests_never_get_a_5xx(gateway):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    base, proc = gateway
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    session = requests.Session()
    counts: Counter = Counter()
    failures: list[str] = []
    reasons: Counter = Counter()  # why schema-valid bodies were refused (checks the schema cannot state)
    started = time.monotonic()
    share = BUDGET_S / (2 * len(OPERATIONS))  # each endpoint and mode gets its part of the budget

    for path in OPERATIONS:
        operation = schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            part_started = time.monotonic()

            @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), derandomize=True)
            @given(case=operation.as_strategy(generation_mode=mode).map(bounded))
            def run(case):
                if time.monotonic() - part_started > share:
                    counts["skipped (budget)"] += 1
                    return
                response = case.call(base_url=base, session=session, timeout=60)
                counts["cases"] += 1
                counts[f"{response.status_code // 100}xx"] += 1
                counts[f"{path} {mode.value} {response.status_code}"] += 1
                if response.status_code >= 500:
                    failures.append(f"{response.status_code} for {case.body!r}: {response.text[:300]}")
                elif response.status_code >= 400:
                    validate(response.json(), "ErrorResponse")  # 4xx: OpenAI's error JSON
                    if mode == GenerationMode.POSITIVE:
                        reasons[response.json()["error"]["message"][:90]] += 1

            run()

    elapsed = time.monotonic() - started
    print(f"\nfuzz: {counts['cases']} cases in {elapsed:.0f}s: 2xx {counts['2xx']}, 4xx {counts['4xx']}, "
          f"5xx {counts['5xx']}" + (f", {counts['skipped (budget)']} skipped past the budget"
                                    if counts["skipped (budget)"] else ""))
    for key in sorted(k for k in counts if k.startswith("/")):
        print(f"  {key}: {counts[key]}")
    for reason, n in reasons.most_common(8):
        print(f"  positive case refused x{n}: {reason}")
    assert not failures, "\n".join(failures[:20])
    assert counts["cases"] >= 40 and counts["2xx"] > 0 and counts["4xx"] > 0, counts
    # still serving
    assert proc.alive, proc.tail()
    r = session.post(base + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                       "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
