"""A small real gateway for tests/loadtest/test_loadtest_hostile.py, in its own process (so the probes
read another process's RSS and burn another process's CPU): the gateway app with its limits
and API-key check, over a scripted backend (slow tokens) and a tiny byte-level tokenizer with
ChatML special tokens. Also serves a fake decode worker's /metrics whose KV usage reads
--kv-busy-s seconds above 0 after each completions request.

    python -m tests.helpers.hostile_probe_server PORT METRICS_PORT TOKENIZER_DIR API_KEY"""
from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KV_BUSY_S = 0.6


def serve_kv_metrics(port: int, last_request: list[float]) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            busy = time.monotonic() - last_request[0] < KV_BUSY_S
            body = ("# TYPE duet_kv_cache_usage_ratio gauge\n"
                    f'duet_kv_cache_usage_ratio{{service="decode"}} {0.25 if busy else 0.0}\n').encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main(port: int, metrics_port: int, tokenizer_dir: str, api_key: str) -> None:
    import uvicorn

    from services.gateway.http_edge import auth
    from services.gateway.http_edge.app import build_app
    from services.gateway.openai_api.endpoints import GatewayContext
    from services.gateway.http_edge.connection_guard import uvicorn_limits
    from services.gateway.http_edge.limits_config import GatewayLimits
    from services.gateway.http_edge.metrics import GatewayMetrics
    from services.gateway.openai_api.prompt_builder import PromptBuilder
    from tests.helpers.gateway_support import ScriptedBackend

    prompts = PromptBuilder.from_model_dir(tokenizer_dir)
    backend = ScriptedBackend(script=[], eos_token_id=prompts.tokenizer.eos_token_id, delay_s=0.02)
    last_request = [-1e9]
    generate = backend.generate

    def generate_and_mark(request):  # the fake KV reads busy for a while after each request
        last_request[0] = time.monotonic()
        return generate(request)

    backend.generate = generate_and_mark
    limits = GatewayLimits(max_concurrent=4, max_queued=8, queue_timeout_s=5.0)
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), "tiny", 256, limits=limits)
    app = build_app(ctx)
    auth.install(app, auth.ApiKeyStore([api_key]), ctx.metrics.registry)
    serve_kv_metrics(metrics_port, last_request)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_limits(limits))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
