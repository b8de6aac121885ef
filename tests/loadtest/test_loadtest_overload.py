"""`duet loadtest overload` against a real gateway (uvicorn, its own limits) over a scripted
backend with slow tokens: the command measures, sends past capacity, and reports 200/429
counts, latencies, the gateway's RSS (this process here) and the recovery request; its exit
status says whether every answer was 200 or 429. The whole stack under 10x load is
tests/e2e/test_e2e_overload.py."""

from __future__ import annotations

import json
import os

import pytest

from loadtest.__main__ import main as loadtest_main
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.connection_guard import uvicorn_limits
from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    prompts = PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), 256))
    backend = ScriptedBackend(script=[], eos_token_id=prompts.tokenizer.eos_token_id, delay_s=0.05)
    limits = GatewayLimits(max_concurrent=2, max_queued=2, queue_timeout_s=2.0)
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), "tiny", 256, limits=limits)
    with UvicornThread(build_app(ctx), **uvicorn_limits(limits)) as srv:
        yield srv


def test_overload_command_reports_200_and_429(server, tmp_path, capsys):
    out = tmp_path / "overload.json"
    code = loadtest_main(["overload", "--base-url", server.base_url, "--factor", "10", "--duration", "3",
                          "--max-tokens", "4", "--calibrate-s", "1", "--calibrate-concurrency", "2",
                          "--gateway-pid", str(os.getpid()), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    figures = json.loads(out.read_text())
    assert set(figures["statuses"]) == {"200", "429"}, figures
    assert figures["capacity_rps"] > 0 and figures["arrival_rps"] >= 9 * figures["capacity_rps"]
    assert figures["rss_peak_mb"] >= figures["rss_before_mb"] > 0
    assert figures["recovery_status"] == 200
    assert "statuses" in printed and "RSS (MB) before/peak/after" in printed
