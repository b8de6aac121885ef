"""A stand-in for the OpenTelemetry Collector image: reads the collector's own config file
(the rendered ConfigMap, mounted where the manifest says), serves its OTLP receivers
(gRPC and HTTP trace export) and its health_check extension, and logs one line per
export, as the collector's `debug` exporter does. Run as
`python -m tests.helpers.k8s_sim.otel_collector --config=/etc/otelcol/config.yaml`."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def describe(request: trace_service_pb2.ExportTraceServiceRequest) -> str:
    parts = []
    for rs in request.resource_spans:
        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
        spans = sum(len(ss.spans) for ss in rs.scope_spans)
        parts.append(f"{spans} spans service.name={attrs.get('service.name', '')} "
                     f"k8s.pod.name={attrs.get('k8s.pod.name', '')}")
    return "; ".join(parts)


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        print(f"Traces (grpc): {describe(request)}", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host or "0.0.0.0", int(port)


def http_server(endpoint: str, otlp: bool) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status":"Server available"}'
            self.send_response(200 if not otlp else 405)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if not otlp or self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
            print(f"Traces (http): {describe(req)}", flush=True)
            out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(split(endpoint), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    cfg = yaml.safe_load(open(args.config))
    protocols = cfg["receivers"]["otlp"]["protocols"]
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), grpc_server)
    grpc_server.add_insecure_port("{}:{}".format(*split(protocols["grpc"]["endpoint"])))
    grpc_server.start()
    servers = [http_server(protocols["http"]["endpoint"], otlp=True)] if "http" in protocols else []
    health = (cfg.get("extensions") or {}).get("health_check")
    if health and "health_check" in (cfg.get("service") or {}).get("extensions", []):
        servers.append(http_server(health.get("endpoint", "0.0.0.0:13133"), otlp=False))
    print(f"Everything is ready. Begin running and processing data. (config {args.config})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())  # PID 1: without a handler SIGTERM would not reach us
    stop.wait()
    grpc_server.stop(2).wait()
    for s in servers:
        s.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
