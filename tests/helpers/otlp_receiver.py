"""Real OTLP trace receivers for tests: what a collector's `otlp` receiver does, minus the rest.

* `GrpcReceiver`: a gRPC server implementing opentelemetry.proto's TraceService/Export
  (the generated stubs of the opentelemetry-proto package);
* `HttpReceiver`: an HTTP server taking POST /v1/traces with an ExportTraceServiceRequest
  in protobuf (gzip-encoded bodies too), as the OTLP/HTTP spec has it.

Both keep every span they got, flattened with its resource's attributes, for assertions.
"""
from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict
    resource: dict
    start_ns: int = 0  # epoch nanoseconds
    end_ns: int = 0


@dataclass
class _Store:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            s.kind, {a.key: _value(a.value) for a in s.attributes}, resource,
                                            s.start_time_unix_nano, s.end_time_unix_nano))
        with self.lock:
            self.requests += 1
            self.spans.extend(got)

    def wait_for(self, predicate, timeout: float) -> list[ReceivedSpan]:
        """Spans matching predicate, once there is at least one (empty on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: _Store):
        self.store = store

    def Export(self, request, context):
        self.store.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcReceiver(_Store):
    """OTLP/gRPC on 127.0.0.1:<free port>; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self):
        super().__init__()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "GrpcReceiver":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)


class HttpReceiver(_Store):
    """OTLP/HTTP on 127.0.0.1:<free port>; `endpoint` is the base URL (the exporter adds /v1/traces)."""

    def __init__(self):
        super().__init__()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(415)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                store.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet test output
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "HttpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
