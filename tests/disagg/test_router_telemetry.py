"""Router telemetry: /metrics over real HTTP, W3C trace context carried through gRPC metadata."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.server import RouterServer
from shared.registry.config import RegistryConfig
from shared.registry.publisher import WorkerPublisher
from shared.registry.worker_info import WorkerInfo
from shared.telemetry.metrics import DuetMetrics
from shared.telemetry.propagation import (extract_grpc_context, extract_http_context, inject_grpc_metadata,
                                          inject_http_headers)
from shared.telemetry.tracing import setup_tracing
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)


def test_route_span_joins_caller_trace_and_metrics_are_served(redis_server):
    exporter = InMemorySpanExporter()
    router_tracing = setup_tracing("router", env={}, extra_exporter=exporter, install_global=False)
    gateway_tracing = setup_tracing("gateway", env={"OTEL_SERVICE_NAME": "gw-test"}, install_global=False)
    assert router_tracing.service_name == "duet-router" and gateway_tracing.service_name == "gw-test"
    assert router_tracing.exporters == ["InMemorySpanExporter"]  # nothing exported by default
    registry = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.2, scan_interval_s=0.2)
    config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, registry=registry)

    async def scenario():
        # metrics_port=0 means "off" in the config; start the HTTP server on a free port ourselves
        server = RouterServer(config, tracing=router_tracing)
        await server.start()
        from shared.telemetry.metrics import start_metrics_server
        http = start_metrics_server(server.metrics, 0, "127.0.0.1")
        pubs = [WorkerPublisher(WorkerInfo(worker_id=i, role=r, address="x:1", model="m", page_size=16), registry)
                for i, r in (("p", "prefill"), ("d", "decode"))]
        for pub in pubs:
            await pub.start()
        assert await server.watcher.wait_for(lambda w: len(w.workers()) == 2, 5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = duet_pb2_grpc.RouterStub(channel)
            with gateway_tracing.tracer.start_as_current_span("gateway-request") as root:
                metadata = inject_grpc_metadata()
                assert any(k == "traceparent" for k, _ in metadata)
                await stub.Route(duet_pb2.RouteRequest(prompt_tokens=10), metadata=metadata)
            trace_id = root.get_span_context().trace_id
        spans = exporter.get_finished_spans()
        route = [s for s in spans if s.name == "route"]
        assert len(route) == 1
        assert route[0].context.trace_id == trace_id, "router span did not join the caller's trace"
        assert route[0].parent is not None and route[0].parent.span_id == root.get_span_context().span_id
        assert route[0].resource.attributes["service.name"] == "duet-router"
        assert route[0].attributes["duet.route"] == "split"
        assert route[0].attributes["duet.placement_reason"] == "bounds"  # 10 tokens, none held: no local prefill
        body = urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=5).read().decode()
        assert 'duet_router_decisions_total{kind="split",model="",reason="bounds"} 1.0' in body
        assert 'duet_requests_total{endpoint="Route",outcome="ok",service="router",status="OK"} 1.0' in body
        # the router sees no token and holds no KV: no latency histogram nor worker gauge stays empty on its page
        for name in ("duet_time_to_first_token_seconds", "duet_inter_token_latency_seconds",
                     "duet_e2e_request_latency_seconds", "duet_kv_transfer_bytes", "duet_kv_cache_usage_ratio",
                     "duet_queued_prefill_tokens", "duet_running_requests"):
            assert name not in body, name
        http.stop()
        for pub in pubs:
            await pub.stop()
        await server.stop()

    asyncio.run(scenario())


def test_metrics_helpers_and_http_propagation():
    metrics = DuetMetrics("prefill", process_metrics=False)
    metrics.observe_kv_transfer("sent", 4096, 0.002)
    metrics.observe_kv_transfer("sent", 1024)
    metrics.request_finished("Prefill", grpc.StatusCode.OK)
    metrics.request_finished("Prefill", "UNAVAILABLE")
    metrics.set_load(kv_usage=0.25, queued_prefill_tokens=300, running_requests=2)
    value = metrics.registry.get_sample_value
    assert value("duet_kv_transfer_bytes_total", {"direction": "sent"}) == 5120
    assert value("duet_kv_transfer_seconds_count") == 1
    labels = {"service": "prefill", "endpoint": "Prefill"}
    assert value("duet_requests_total", {**labels, "outcome": "ok", "status": "OK"}) == 1
    assert value("duet_requests_total", {**labels, "outcome": "error", "status": "UNAVAILABLE"}) == 1
    assert value("duet_kv_cache_usage_ratio") == 0.25 and value("duet_queued_prefill_tokens") == 300
    # two DuetMetrics in one process do not collide (one registry each)
    DuetMetrics("decode", process_metrics=False).observe_kv_transfer("received", 1)
    assert value("duet_kv_transfer_bytes_total", {"direction": "received"}) is None
    # a worker's token latencies carry the phase it served; a phase nobody took has no series
    metrics.latency("prefill").ttft.observe(0.2)
    assert metrics.latency("prefill") is metrics.latency("prefill")  # children resolved once
    assert value("duet_time_to_first_token_seconds_count", {"phase": "prefill"}) == 1
    assert value("duet_time_to_first_token_seconds_count", {"phase": "decode"}) is None
    assert not hasattr(metrics, "route_decisions") and not hasattr(DuetMetrics("router"), "time_to_first_token")

    tracing = setup_tracing("gateway", env={}, install_global=False)
    with tracing.tracer.start_as_current_span("outer") as span:
        headers = inject_http_headers({"Content-Type": "x"})
    ctx = extract_http_context({k.upper(): v for k, v in headers.items()})
    from opentelemetry import trace
    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
    ctx2 = extract_grpc_context([("traceparent", headers["traceparent"]), ("x-bin", b"\x00")])
    assert trace.get_current_span(ctx2).get_span_context().span_id == span.get_span_context().span_id


def test_otlp_settings_from_the_standard_environment(caplog):
    """OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_{PROTOCOL,ENDPOINT} pick the exporter and its URL
    as the OTel spec says; both OTLP exporters are installed by default (no extra)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    from shared.telemetry.otlp import OtlpTarget, otlp_target
    from shared.telemetry.tracing import exporter_names

    assert otlp_target({}) == OtlpTarget("grpc", "http://localhost:4317")
    assert otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == OtlpTarget(
        "http/protobuf", "http://localhost:4318/v1/traces")
    # the base endpoint gets the signal path over HTTP, not over gRPC; the traces one is used as is
    assert otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT":
                        "http://collector:4318/"}).endpoint == "http://collector:4318/v1/traces"
    assert otlp_target({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}).endpoint == "http://collector:4317"
    assert otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:9/x"}) == OtlpTarget("http/protobuf", "http://b:9/x")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "grcp"})

    assert exporter_names({}) == []  # nothing configured: nothing exported
    assert exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == ["otlp"]  # an endpoint says where
    assert exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []

    def provider_exporters(env):
        tracing = setup_tracing("decode", env=env, install_global=False)
        processors = tracing.provider._active_span_processor._span_processors
        found = [type(p.span_exporter if hasattr(p, "span_exporter") else p._batch_processor._exporter)
                 for p in processors]
        tracing.shutdown()
        return tracing, found

    tracing, found = provider_exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert tracing.exporters == ["otlp"] and found == [GrpcExporter] and tracing.service_name == "duet-decode"
    _, found = provider_exporters({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert found == [HttpExporter]
    with caplog.at_level("ERROR"):
        tracing, found = provider_exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "udp"})
    assert found == [] and tracing.exporters == [] and "udp" in caplog.text  # said loudly, not silently dropped


def test_outcome_of_every_protocol_status():
    from shared.telemetry.requests import status_label

    assert [status_label(s)[0] for s in (200, 400, 404, 429, 499, 500, 503, 504, 408)] == [
        "ok", "rejected", "rejected", "rejected", "cancelled", "error", "error", "timeout", "timeout"]
    assert [status_label(s) for s in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, "INVALID_ARGUMENT",
                                      "UNAVAILABLE", "INTERNAL", "CANCELLED", "DEADLINE_EXCEEDED")] == [
        ("ok", "OK"), ("rejected", "RESOURCE_EXHAUSTED"), ("rejected", "INVALID_ARGUMENT"), ("error", "UNAVAILABLE"),
        ("error", "INTERNAL"), ("cancelled", "CANCELLED"), ("timeout", "DEADLINE_EXCEEDED")]


def test_gateway_and_router_processes_label_duet_requests_total_alike(redis_server, tmp_path):
    """`duet router` and `duet gateway` as processes, no worker: a chat request is refused by
    the router (UNAVAILABLE) and so by the gateway (503). Both /metrics count it in
    duet_requests_total with the same label names, one query apart."""
    import httpx

    from shared.telemetry.requests import REQUEST_LABELS
    from tests.helpers.stack import Process, duet_argv, scrape, wait_until
    from tests.helpers.redis_server import free_port

    router_port, router_metrics, gateway_port = free_port(), free_port(), free_port()
    router = Process("router", duet_argv("router", "--host", "127.0.0.1", "--port", str(router_port),
                                         "--metrics-port", str(router_metrics), "--redis-url", redis_server.url),
                     tmp_path / "router.log").start()
    gateway = Process("gateway", duet_argv("gateway", "--host", "127.0.0.1", "--port", str(gateway_port),
                                           "--router-address", f"127.0.0.1:{router_port}"),
                      tmp_path / "gateway.log").start()
    try:
        base = f"http://127.0.0.1:{gateway_port}"
        wait_until(lambda: scrape(f"127.0.0.1:{router_metrics}") and httpx.get(base + "/v1/models").status_code == 200,
                   60, "router and gateway up")
        reply = httpx.post(base + "/v1/chat/completions", timeout=30, json={
            "model": httpx.get(base + "/v1/models").json()["data"][0]["id"], "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503, reply.text
        gateway_samples = [lab for n, lab, v in scrape(f"127.0.0.1:{gateway_port}").samples
                           if n == "duet_requests_total"]
        router_samples = [lab for n, lab, v in scrape(f"127.0.0.1:{router_metrics}").samples
                          if n == "duet_requests_total"]
        assert gateway_samples == [{"service": "gateway", "endpoint": "chat_completions", "outcome": "error",
                                    "status": "503"}]
        assert router_samples == [{"service": "router", "endpoint": "Route", "outcome": "error",
                                   "status": "UNAVAILABLE"}]
        assert set(gateway_samples[0]) == set(router_samples[0]) == set(REQUEST_LABELS)
    except BaseException:
        print(router.tail(), gateway.tail(), sep="\n")
        raise
    finally:
        gateway.stop()
        router.stop()
